"""Deadlock detection: a graph that can no longer move is stopped, with its cycle of waits named
(exit 4), and a slow or polling stage is never mistaken for one. Each run uses a short
``deadlock_timeout_s`` so the suite stays fast."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

import csp
from csp.observe.backpressure import summarize
from csp.observe.stats_reader import read_stats

pytestmark = pytest.mark.timeout(30)


class Split(csp.Process):
    """Sends 0..n-1 alternately to ``a`` and ``b``."""

    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        n: int = 100

    outputs = {"a": int, "b": int}

    def run(self, inputs, outputs):
        for i in range(self.options.n):
            outputs["a" if i % 2 == 0 else "b"].send(i)


class MergeOnlyA(csp.Process):
    """Has inputs ``a`` and ``b`` but reads only ``a``: the user bug that deadlocks."""

    inputs = {"a": int, "b": int}

    def run(self, inputs, outputs):
        for _ in inputs["a"]:
            pass


class AsyncMergeOnlyA(MergeOnlyA):
    async def run(self, inputs, outputs):
        async for _ in inputs["a"]:
            pass


class SlowSource(csp.Process):
    """Sends one item, then computes (here: sleeps, outside any channel call) for ``busy_s``."""

    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        busy_s: float = 1.0
        poll: bool = False  # busy-wait with send_nowait instead of sleeping

    outputs = {"out": int}

    def run(self, inputs, outputs):
        outputs["out"].send(0)
        t_end = time.perf_counter() + self.options.busy_s
        while time.perf_counter() < t_end:
            time.sleep(0.01)
        if self.options.poll:  # a polling source: retries a full channel without parking
            while True:
                try:
                    outputs["out"].send_nowait(1)
                    break
                except csp.WouldBlock:
                    time.sleep(0.01)
        outputs["out"].send(2)


class Sink(csp.Process):
    inputs = {"inp": int}

    def run(self, inputs, outputs):
        self.ctx.app.extend(inputs["inp"])


def _deadlock_graph(merge=MergeOnlyA) -> csp.Graph:
    g = csp.Graph(runtime=csp.RuntimeSpec(deadlock_timeout_s=0.4))
    g.channel("a", capacity=1).channel("b", capacity=1)
    g.process("split", Split, outputs={"a": "a", "b": "b"})
    g.process("merge", merge, inputs={"a": "a", "b": "b"})
    return g


@pytest.mark.parametrize("merge", [MergeOnlyA, AsyncMergeOnlyA], ids=["thread", "async"])
def test_unread_input_is_a_deadlock_named_with_its_cycle(tmp_path, merge):
    """Invariant: a graph where every live process waits on a channel and nothing moves is stopped
    after deadlock_timeout_s with exit 4, and the cycle of waits names who blocks on what; the
    stats log's final record carries it so csp.inspect says "deadlock", not "none clear"."""
    t0 = time.perf_counter()
    rt = csp.Runtime(_deadlock_graph(merge), run_dir=tmp_path, join_timeout_s=5)
    result = rt.run()
    assert time.perf_counter() - t0 < 10
    assert (result.status, result.exit_code) == ("deadlocked", 4)
    assert result.deadlock is not None
    assert "split[0] blocked sending on 'b' (full: 1/1), which merge[0] never receives" in result.deadlock
    assert "merge[0] waits to receive on 'a' (empty), which split[0] never sends" in result.deadlock
    summary = summarize(read_stats(tmp_path))
    assert summary.status == "deadlocked" and summary.exit_code == 4
    assert summary.verdict.deadlock and summary.verdict.text.startswith("deadlock: split[0] blocked")


def test_deadlock_timeout_zero_turns_the_check_off():
    """Invariant: deadlock_timeout_s = 0 never stops a run (the user asked for no check)."""
    g = _deadlock_graph()
    g.runtime = csp.RuntimeSpec(deadlock_timeout_s=0)
    rt = csp.Runtime(g)
    assert rt.deadlock_timeout_s == 0
    timer = threading.Timer(1.5, rt.abort)  # the only way out of a real deadlock without the check
    timer.start()
    try:
        result = rt.run()
    finally:
        timer.cancel()
    assert result.status == "aborted" and result.deadlock is None


@pytest.mark.parametrize("poll", [False, True], ids=["computing", "polling"])
def test_busy_or_polling_stage_is_not_a_deadlock(poll):
    """Invariant: only replicas parked inside a channel call count as waiting; a stage computing
    (or polling with send_nowait) far longer than deadlock_timeout_s while everyone else waits
    is not a deadlock, and the run completes."""
    g = csp.Graph(runtime=csp.RuntimeSpec(deadlock_timeout_s=0.2))
    g.channel("c", capacity=0 if poll else 1)
    g.process("src", SlowSource, outputs={"out": "c"}, options={"busy_s": 1.0, "poll": poll})
    g.process("sink", Sink, inputs={"inp": "c"})
    got: list[int] = []
    result = csp.Runtime(g, app=got).run()
    assert (result.status, result.exit_code, result.deadlock) == ("completed", 0, None)
    assert got == [0, 1, 2] if poll else got == [0, 2]


def test_graph_file_runtime_table_and_partial_runtimes(tmp_path):
    """Invariant: [runtime].deadlock_timeout_s reaches the runtime from a graph file, bad values
    are a GraphError naming the path, and a runtime that runs only part of the graph (csp.distributed's
    share of a rank) never judges a deadlock: a peer it cannot see may be busy."""
    f = tmp_path / "g.toml"
    f.write_text("[runtime]\ndeadlock_timeout_s = 2.5\n")
    assert csp.load_spec(f).runtime.deadlock_timeout_s == 2.5
    f.write_text("[runtime]\ndeadlock_timeout_s = -1\n")
    with pytest.raises(csp.GraphError, match="deadlock_timeout_s"):
        csp.load_spec(f)
    g = _deadlock_graph()
    assert csp.Runtime(g).deadlock_timeout_s == 0.4
    assert csp.Runtime(g, deadlock_timeout_s=7).deadlock_timeout_s == 7
    assert csp.Runtime(g, instances=[("split", 0), ("merge", 0)]).deadlock_timeout_s == 0
    from csp.run import EXIT_CODES
    assert "deadlock" in EXIT_CODES[4]
