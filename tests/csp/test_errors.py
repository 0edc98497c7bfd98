"""csp's error family: every error csp raises is a ``csp.CspError`` (one ``except`` catches them all), and the
classes that replaced a builtin are still that builtin, so ``except ValueError`` callers keep
working. The exceptions are the ones csp/errors.py's docstring lists."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import csp
import csp.errors
from csp.core.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
# builtins csp raises on purpose (csp/errors.py's docstring says why): Python protocols, argparse's
# usage error, and the interpreter's exit
ALLOWED_BUILTINS = {"StopIteration", "StopAsyncIteration", "AttributeError", "NotImplementedError",
                    "SystemExit", "ArgumentTypeError"}


def _raised_names(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``raise Name(...)`` / ``raise Name`` / ``raise mod.Name(...)``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(exc, ast.Name):
            out.append((node.lineno, exc.id))
        elif isinstance(exc, ast.Attribute):
            out.append((node.lineno, exc.attr))
    return out


def test_every_raise_in_csp_is_a_csp_error_or_a_listed_builtin():
    """Walk every raise statement in csp/: the class raised is a CspError subclass (looked up in
    csp.errors), one of the listed builtins, or a helper call / variable whose result the
    exercising tests below check (``check.error(item)``, ``self._end_of_stream()``, ...)."""
    helpers = {"error", "_end_of_stream", "_timed_out"}  # return csp errors: exercised below
    bad = []
    sites = 0
    for path in sorted((ROOT / "csp").rglob("*.py")):
        for line, name in _raised_names(path):
            sites += 1
            cls = getattr(csp.errors, name, None)
            if isinstance(cls, type) and issubclass(cls, csp.CspError):
                continue
            if name in ALLOWED_BUILTINS or name in helpers:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: raise {name}")
    assert sites > 40  # the walk found csp's raise sites
    assert bad == [], "raise a csp.errors class (deriving from CspError and the builtin):\n" + "\n".join(bad)


def test_every_error_class_is_exported_and_a_csp_error():
    classes = [v for v in vars(csp.errors).values()
               if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == "csp.errors"]
    assert len(classes) == len(csp.errors.__all__)
    for cls in classes:
        assert issubclass(cls, csp.CspError), cls
        assert getattr(csp, cls.__name__) is cls  # exported from csp


@pytest.mark.parametrize("capacity", [None, -1, 1.5, True])
def test_channel_bad_capacity_is_a_csp_error_and_a_value_error(capacity):
    with pytest.raises(csp.ChannelConfigError) as info:
        csp.channel(int, capacity, name="c")
    assert isinstance(info.value, csp.CspError) and isinstance(info.value, ValueError)


def test_send_of_the_wrong_type_is_a_csp_error_and_a_type_error():
    tx, _rx = csp.channel(int, 1, name="ints")
    with pytest.raises(TypeError) as info:
        tx.send("three")
    assert isinstance(info.value, csp.ItemTypeError) and isinstance(info.value, csp.CspError)
    assert info.value.channel == "ints"


def test_send_timeout_and_receive_timeout_are_csp_errors_and_timeout_errors():
    tx, rx = csp.channel(int, 0, name="r")
    for call in (lambda: tx.send(1, timeout=0.01), lambda: rx.receive(timeout=0.01)):
        with pytest.raises(TimeoutError) as info:
            call()
        assert isinstance(info.value, csp.ChannelTimeout) and isinstance(info.value, csp.CspError)
        assert info.value.channel == "r"


def test_ordered_seq_errors_are_csp_errors_and_value_errors():
    tx, _rx = csp.channel(int, 4, name="o", ordered=True)
    tx.send(1, seq=0)
    for seq in (None, 0):  # missing, repeated
        with pytest.raises(ValueError) as info:
            tx.send(2, seq=seq)
        assert isinstance(info.value, csp.SeqError) and isinstance(info.value, csp.CspError)


def test_async_call_outside_an_event_loop_is_a_csp_error():
    tx, _rx = csp.channel(int, 0)  # rendezvous: the send must park, on a loop it cannot find
    coro = tx.asend(1)
    with pytest.raises(RuntimeError) as info:
        for _ in range(3):  # drive the coroutine by hand, on no event loop: the checkpoint, then the park
            coro.send(None)
    coro.close()
    assert isinstance(info.value, csp.NoEventLoop) and isinstance(info.value, csp.CspError)
    tx1, rx1 = csp.channel(int, 1)
    asyncio.run(tx1.asend(1))  # inside a loop the call works
    assert rx1.receive_nowait() == 1


def test_register_errors_are_csp_errors_and_their_builtins():
    reg = Registry()
    with pytest.raises(ValueError) as bad_kind:
        reg.register("has space", csp.Process)
    with pytest.raises(TypeError) as not_process:
        reg.register("x.y", int)
    assert isinstance(bad_kind.value, csp.RegistryError) and isinstance(bad_kind.value, csp.CspError)
    assert isinstance(not_process.value, csp.NotAProcess) and isinstance(not_process.value, csp.CspError)


def test_pinned_pool_errors_are_csp_errors_and_their_builtins():
    from csp.cuda.handoff import PinnedPool

    with pytest.raises(ValueError) as small:
        PinnedPool(max_bytes=1)
    pool = PinnedPool(max_bytes=PinnedPool.MIN_BYTES)
    with pytest.raises(ValueError) as large:
        pool.take(PinnedPool.MIN_BYTES + 1)
    buf = pool.take(16)
    with pytest.raises(TimeoutError) as timeout:
        pool.take(16, timeout=0.01)  # the only buffer is taken
    pool.give(buf)
    assert all(isinstance(e.value, csp.PinnedPoolError) for e in (small, large))
    assert isinstance(timeout.value, csp.PinnedPoolTimeout)
    assert all(isinstance(e.value, csp.CspError) for e in (small, large, timeout))


def test_stats_reading_errors_are_csp_errors(tmp_path):
    from csp.observe.backpressure import read_stats

    with pytest.raises(FileNotFoundError) as missing:
        read_stats(tmp_path)
    (tmp_path / "stats.jsonl").write_text('{"kind": "snapshot", "t": "soon"}\n')
    with pytest.raises(ValueError) as malformed:
        read_stats(tmp_path / "stats.jsonl")
    assert isinstance(missing.value, csp.StatsNotFound) and isinstance(missing.value, csp.CspError)
    assert isinstance(malformed.value, csp.StatsFormatError) and isinstance(malformed.value, csp.CspError)
