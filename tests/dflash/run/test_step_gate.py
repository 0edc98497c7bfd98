"""dflash.run.step_gate: a step on new shapes runs alone in the process, seen shapes run together."""
from __future__ import annotations

import threading
import time

import pytest

from dflash.run.step_gate import StepGate, _SharedExclusiveLock, is_trace_race

WAIT = 5.0  # seconds any expected event may take; the tests finish in milliseconds when correct


def _until(cond, timeout=WAIT):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.001)
    return True


def _thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_steps_on_seen_shapes_of_two_stages_overlap():
    lock = _SharedExclusiveLock()
    target, drafter = StepGate(lock), StepGate(lock)
    for g in (target, drafter):  # first steps: each alone
        with g.step((4, 8)):
            pass
    inside = threading.Barrier(2, timeout=WAIT)  # both must be inside at once, or it times out

    def run(g):
        with g.step((4, 8)):
            inside.wait()

    threads = [_thread(lambda g=g: run(g)) for g in (target, drafter)]
    for t in threads:
        t.join(WAIT)
    assert not inside.broken, "two shared steps did not run concurrently"


def test_a_step_on_a_new_shape_waits_for_steps_in_flight_and_runs_alone():
    lock = _SharedExclusiveLock()
    target, drafter = StepGate(lock), StepGate(lock)
    with target.step((4, 8)):
        pass
    release_target, log = threading.Event(), []

    def target_step():
        with target.step((4, 8)):  # seen: shared
            log.append("target in")
            release_target.wait(WAIT)
            log.append("target out")

    def drafter_step():
        with drafter.step((4, 8)):  # new to the drafter: exclusive
            log.append("drafter in")
            time.sleep(0.05)
            log.append("drafter out")

    t1 = _thread(target_step)
    assert _until(lambda: log == ["target in"])
    t2 = _thread(drafter_step)
    assert _until(lambda: lock.state()[2] == 1)  # the drafter waits behind the target's step
    assert log == ["target in"]
    # a further target step arriving now waits behind the waiting exclusive one
    t3 = _thread(lambda: (target.step((4, 8)).__enter__(), log.append("target again")))
    time.sleep(0.05)
    assert "target again" not in log
    release_target.set()
    for t in (t1, t2, t3):
        t.join(WAIT)
    assert log == ["target in", "target out", "drafter in", "drafter out", "target again"]


def test_a_failed_step_leaves_its_shapes_new_and_releases_the_lock():
    lock = _SharedExclusiveLock()
    gate = StepGate(lock)
    with pytest.raises(RuntimeError, match="boom"):
        with gate.step((1, 8)):
            raise RuntimeError("boom")
    assert lock.state() == (0, False, 0)
    assert gate.is_new((1, 8))
    with gate.step((1, 8)):
        assert lock.state() == (0, True, 0)  # still exclusive: the shape never completed a step
    assert not gate.is_new((1, 8))
    with gate.step((1, 8)):
        assert lock.state() == (1, False, 0)


def test_a_nested_step_in_one_thread_runs_inside_the_outer_hold():
    lock = _SharedExclusiveLock()
    outer, inner = StepGate(lock), StepGate(lock)
    done = []

    def run():
        with outer.step((2, 2)), inner.step((3, 3)):  # would deadlock if the inner one waited
            done.append(lock.state())

    t = _thread(run)
    t.join(WAIT)
    assert done == [(0, True, 0)]


def test_a_step_that_another_threads_trace_interrupts_runs_again_alone_after_it():
    """The race itself, on torch: while one thread traces with torch.fx (as torch.compile's
    autograd tracing does) holding the gate shared, a compiled call in another thread raises;
    :meth:`StepGate.run` undoes the attempt and reruns it exclusively once the trace is over."""
    import torch

    lock = _SharedExclusiveLock()
    compiling, victim = StepGate(lock), StepGate(lock)
    for g in (compiling, victim):  # shapes both have seen: their next steps are shared
        with g.step((2,)):
            pass
    tracing, finish = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x):
            tracing.set()  # inside torch.fx's trace: nn.Module.__call__ is patched process-wide
            assert finish.wait(WAIT)
            return x + 1

    traced = []
    t = _thread(lambda: compiling.run((2,), lambda: traced.append(torch.fx.symbolic_trace(Slow()))))
    assert tracing.wait(WAIT)
    double = torch.compile(lambda x: 2 * x, backend="eager")
    attempts, states = [], []

    def step():
        attempts.append(1)
        states.append(lock.state())
        return double(torch.ones(2))

    out = victim.run((2,), step, again=finish.set)  # the undo lets the trace finish here
    t.join(WAIT)
    assert torch.equal(out, torch.full((2,), 2.0)) and len(traced) == 1
    assert len(attempts) == 2 and victim.reruns == 1 and compiling.reruns == 0
    assert states == [(2, False, 0), (0, True, 0)]  # first beside the trace, then alone
    assert lock.state() == (0, False, 0)


def test_a_compile_during_a_step_on_seen_shapes_is_said_once(caplog, monkeypatch):
    """A guard other than a shape failing (here: a new input length behind an unchanged step key)
    compiles inside a shared step: the run log says so once, naming the stage and the shapes."""
    import torch

    from dflash.run import step_gate

    monkeypatch.setattr(step_gate, "_said_compiled", False)
    gate = StepGate(_SharedExclusiveLock(), name="drafter[0]")
    double = torch.compile(lambda x: 2 * x, backend="eager")
    with gate.step(("batch",)):
        double(torch.ones(5))  # a new shape: compiles, alone
    with caplog.at_level("WARNING", logger="dflash.step_gate"):
        for n in (5, 5, 6, 7):  # the same key; 6 and 7 compile beside the other stages
            with gate.step(("batch",)):
                double(torch.ones(n))
    said = [r.getMessage() for r in caplog.records if "compiled a graph" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("drafter[0]: ") and "('batch',)" in said[0]


def test_only_the_trace_race_is_rerun():
    lock = _SharedExclusiveLock()
    gate, calls = StepGate(lock), []
    with gate.step((1,)):
        pass

    def fails():
        calls.append(1)
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        gate.run((1,), fails, again=lambda: calls.append("again"))
    assert calls == [1] and gate.reruns == 0 and lock.state() == (0, False, 0)
    race = RuntimeError("Detected that you are using FX to symbolically trace a "
                        "dynamo-optimized function. This is not supported at the moment.")
    assert is_trace_race(race)
    assert not is_trace_race(ValueError("symbolically trace a dynamo-optimized function"))


def test_a_data_parallel_replica_is_stopped_with_the_reason_not_rerun():
    """A replica whose step is a collective cannot repeat it alone: the race stops it, saying why.
    Nor does it hold the lock alone on new shapes: its all-reduce may wait on a stage it would hold off."""
    lock = _SharedExclusiveLock()
    gate, calls = StepGate(lock, name="drafter[1]", data_parallel=True), []
    with gate.step((1,)):
        assert lock.state() == (1, False, 0)
    race = RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function.")

    def interrupted():
        calls.append(1)
        raise race

    with pytest.raises(RuntimeError, match=r"^drafter\[1\]: .* a data-parallel replica cannot run again") as err:
        gate.run((1,), interrupted, again=lambda: calls.append("again"))
    assert err.value.__cause__ is race and calls == [1] and gate.reruns == 0
    assert lock.state() == (0, False, 0)


def test_a_run_passes_every_target_forward_and_drafter_step_through_the_gate(tmp_path, monkeypatch):
    """A tiny run with two target replicas: every forward and every optimizer step holds the gate,
    the first step of each stage instance holds it alone, and the run's result is unchanged."""
    from dflash.run import step_gate
    from dflash.run.cli import main
    from tests.dflash.run.test_run_e2e import losses, small

    seen, real = [], step_gate.StepGate.step

    def recording(self, shapes):
        cm = real(self, shapes)

        class Rec:
            def __enter__(_):
                cm.__enter__()
                seen.append((threading.current_thread().name, id(self), shapes, step_gate.process_lock().state()))

            def __exit__(_, *exc):
                return cm.__exit__(*exc)
        return Rec()

    monkeypatch.setattr(step_gate.StepGate, "step", recording)
    cache = tmp_path / "cache"
    assert main(small(tmp_path / "run", cache, "process.target.replicas=2", steps=6)) == 0
    gates = {}
    for thread, gate, shapes, state in seen:
        gates.setdefault(gate, []).append((thread, shapes, state))
    drafter = [g for g in gates.values() if g[0][0].startswith("drafter")]
    targets = [g for g in gates.values() if g[0][0].startswith("target")]
    assert len(drafter) == 1 and len(drafter[0]) == 6  # one record per optimizer step
    assert len(targets) == 2 and sum(len(g) for g in targets) >= 6
    for records in gates.values():
        first_of_shape = {}
        for _, shapes, (shared, exclusive, _) in records:
            alone = first_of_shape.setdefault(shapes, True)
            assert (exclusive, shared) == ((True, 0) if alone else (False, shared)), (shapes, shared, exclusive)
            first_of_shape[shapes] = False
    monkeypatch.setattr(step_gate.StepGate, "step", real)
    assert main(small(tmp_path / "plain", cache, "process.target.replicas=2", steps=6)) == 0
    assert losses(tmp_path / "run") == losses(tmp_path / "plain")
