"""The runtime: completion, failure in every position (source, middle, one replica, sink, setup,
teardown, async), graceful drain (API and SIGINT), abort (API and second SIGINT), no thread left
behind, contexts and process statistics. Ordering uses events, never sleeps."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any

import msgspec
import pytest

import csp

pytestmark = pytest.mark.timeout(30)


class Boom(RuntimeError):
    """The injected failure."""


class Harness:
    """Shared with the processes through ``ctx.app``."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.received: list[int] = []
        self.torn_down: list[str] = []
        self.contexts: list[csp.Context] = []
        self.full = threading.Event()  # the source found its output channel full
        self.release = threading.Event()  # lets a waiting sink start consuming
        self.saw_stop = threading.Event()  # the source observed ctx.stopping()


class Source(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        n: int = -1  # -1 = until stopped
        fail_at: int = -1
        fail_in_setup: bool = False
        ignore_stop: bool = False

    outputs = {"out": int}

    def setup(self):
        self.ctx.app.contexts.append(self.ctx)
        if self.options.fail_in_setup:
            raise Boom("source setup")

    def run(self, inputs, outputs):
        h, o, i = self.ctx.app, self.options, 0
        while o.n < 0 or i < o.n:
            if self.ctx.stopping():
                h.saw_stop.set()
                if not o.ignore_stop:
                    return
            if i == o.fail_at:
                raise Boom(f"source item {i}")
            try:
                outputs["out"].send_nowait(i)
            except csp.WouldBlock:
                h.full.set()
                outputs["out"].send(i)
            h.sent.append(i)
            i += 1

    def teardown(self):
        self.ctx.app.torn_down.append(self.ctx.qualname)


class RelayOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fail_at: int = -1  # fail on the k-th item this replica receives
    fail_replica: int = -1  # -1 = every replica
    fail_in_teardown: bool = False


class Relay(csp.Process):
    Options = RelayOptions
    inputs = {"inp": int}
    outputs = {"out": int}

    def setup(self):
        self.ctx.app.contexts.append(self.ctx)

    def _check(self, k):
        o = self.options
        if k == o.fail_at and o.fail_replica in (-1, self.ctx.replica):
            raise Boom(f"{self.ctx.qualname} item {k}")

    def run(self, inputs, outputs):
        for k, v in enumerate(inputs["inp"]):
            self._check(k)
            outputs["out"].send(v)

    def teardown(self):
        self.ctx.app.torn_down.append(self.ctx.qualname)
        if self.options.fail_in_teardown and self.options.fail_replica in (-1, self.ctx.replica):
            raise Boom(f"{self.ctx.qualname} teardown")


class AsyncRelay(Relay):
    async def run(self, inputs, outputs):
        k = 0
        async for v in inputs["inp"]:
            self._check(k)
            await outputs["out"].asend(v)
            k += 1


class StrictRelay(Relay):
    """Lets EndOfStream escape run(): that is a normal end."""

    def run(self, inputs, outputs):
        while True:
            outputs["out"].send(inputs["inp"].receive())


class Sink(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        fail_at: int = -1
        wait_release: bool = False

    inputs = {"inp": int}

    def setup(self):
        self.ctx.app.contexts.append(self.ctx)

    def run(self, inputs, outputs):
        h = self.ctx.app
        for k, v in enumerate(inputs["inp"]):
            if k == 0 and self.options.wait_release:
                assert h.release.wait(20), "test never released the sink"
            if k == self.options.fail_at:
                raise Boom(f"sink item {k}")
            h.received.append(v)

    def teardown(self):
        self.ctx.app.torn_down.append(self.ctx.qualname)


class Stubborn(csp.Process):
    """A sink that ignores its channel and waits on an event only the test sets."""

    inputs = {"inp": int}

    def run(self, inputs, outputs):
        assert self.ctx.app.release.wait(20)


ALL = ["src[0]", "relay[0]", "relay[1]", "sink[0]"]


def pipeline(src: dict | None = None, relay: dict | None = None, sink: dict | None = None,
             relay_cls: type = Relay, replicas: int = 2, capacity: int = 4) -> csp.Graph:
    """src -> a -> relay[0..replicas-1] -> b -> sink"""
    g = csp.Graph(trace=csp.TraceSpec(stats_interval_s=0.05))
    g.channel("a", capacity=capacity).channel("b", capacity=capacity)
    g.process("src", Source, outputs={"out": "a"}, options=src)
    g.process("relay", relay_cls, inputs={"inp": "a"}, outputs={"out": "b"}, replicas=replicas,
              options=relay)
    g.process("sink", Sink, inputs={"inp": "b"}, options=sink)
    return g


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    """Invariant: run() returns only after every thread it started has ended."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before]
    assert not left, f"threads left behind: {left}"


def read_stats(run_dir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "csp" / "stats.jsonl").read_text().splitlines()]


def wait_for(condition, timeout: float = 20.0) -> bool:
    """Bounded poll for a condition no event signals (e.g. that a signal handler has run)."""
    deadline = time.perf_counter() + timeout
    pause = threading.Event()
    while not condition():
        if time.perf_counter() > deadline:
            return False
        pause.wait(0.002)
    return True


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, name="test-driver", daemon=True)
    t.start()
    return t


# -- completion -------------------------------------------------------------------------------

@pytest.mark.parametrize("relay_cls", [Relay, AsyncRelay, StrictRelay])
def test_completes_and_delivers_everything(relay_cls, tmp_path):
    h = Harness()
    rt = csp.Runtime(pipeline(src={"n": 300}, relay_cls=relay_cls), run_dir=tmp_path, app=h)
    result = rt.run()
    assert (result.status, result.exit_code) == ("completed", 0) and result.duration_s > 0
    assert sorted(h.received) == list(range(300))
    assert sorted(h.torn_down) == sorted(ALL)
    procs = rt.statistics()["processes"]
    assert procs["src[0]"].items_out == 300 and procs["sink[0]"].items_in == 300
    assert procs["relay[0]"].items_in + procs["relay[1]"].items_in == 300
    assert all(p.state == "done" and p.busy_s >= 0 for p in procs.values())
    final = read_stats(tmp_path)[-1]
    assert (final["kind"], final["status"], final["exit_code"]) == ("final", "completed", 0)


def test_contexts(tmp_path):
    h = Harness()
    g = pipeline(src={"n": 3})
    g.processes["relay"].devices = ["cpu", "cpu"]
    csp.Runtime(g, run_dir=tmp_path, app=h).run()
    by_name = {c.qualname: c for c in h.contexts}
    assert sorted(by_name) == sorted(ALL)
    r1 = by_name["relay[1]"]
    assert (r1.name, r1.replica, r1.replicas, r1.run_dir, r1.app) == ("relay", 1, 2, tmp_path, h)
    assert str(r1.device) == "cpu" and r1.stream is None
    assert by_name["src[0]"].device is None and by_name["src[0]"].replicas == 1


def test_runs_once():
    rt = csp.Runtime(pipeline(src={"n": 1}), app=Harness())
    rt.run()
    with pytest.raises(RuntimeError, match="runs once"):
        rt.run()


# -- failures ---------------------------------------------------------------------------------

FAILURES = {
    "source": (dict(src={"fail_at": 5}), "src", 0),
    "source-setup": (dict(src={"fail_in_setup": True}), "src", 0),
    "middle-one-replica": (dict(relay={"fail_at": 0, "fail_replica": 1}), "relay", 1),
    "middle-async-replica": (dict(relay={"fail_at": 3, "fail_replica": 0}, relay_cls=AsyncRelay), "relay", 0),
    "middle-teardown": (dict(src={"n": 10}, relay={"fail_in_teardown": True, "fail_replica": 1}), "relay", 1),
    "sink": (dict(sink={"fail_at": 2}), "sink", 0),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failure_stops_everything_and_names_the_replica(case, tmp_path):
    """One exception anywhere ends the run in bounded time with ProcessFailed naming it; every
    replica is torn down; blocked neighbours (the source sends forever) are woken by the abort."""
    kwargs, name, replica = FAILURES[case]
    h = Harness()
    rt = csp.Runtime(pipeline(**kwargs), run_dir=tmp_path, app=h, join_timeout_s=10)
    with pytest.raises(csp.ProcessFailed) as info:
        rt.run()
    err = info.value
    assert (err.process, err.replica) == (name, replica)
    assert f"{name}[{replica}]" in str(err) and isinstance(err.__cause__, Boom)
    assert sorted(h.torn_down) == sorted(ALL)
    procs = rt.statistics()["processes"]
    assert procs[f"{name}[{replica}]"].state == "failed"
    final = read_stats(tmp_path)[-1]
    assert (final["status"], final["exit_code"]) == ("failed", 1)


def test_failure_in_async_sink_with_thread_neighbours():
    class AsyncSink(Sink):
        async def run(self, inputs, outputs):
            async for v in inputs["inp"]:
                if v == 7:
                    raise Boom("async sink")

    g = csp.Graph().channel("a", capacity=2)
    g.process("src", Source, outputs={"out": "a"}).process("sink", AsyncSink, inputs={"inp": "a"})
    with pytest.raises(csp.ProcessFailed, match=r"sink\[0\]") as info:
        csp.Runtime(g, app=Harness()).run()
    assert isinstance(info.value.__cause__, Boom)


def test_stuck_thread_is_reported_loudly(caplog):
    """A process that ignores its channels cannot be killed: run() still returns after
    join_timeout_s, names the thread, and logs its stack."""
    h = Harness()
    g = csp.Graph().channel("a", capacity=4)
    g.process("src", Source, outputs={"out": "a"}, options={"fail_at": 2})
    g.process("stub", Stubborn, inputs={"inp": "a"})
    try:
        with pytest.raises(csp.ProcessFailed, match=r"threads still running: stub\[0\]"):
            csp.Runtime(g, app=h, join_timeout_s=0.2).run()
        assert "stub[0] did not stop" in caplog.text
    finally:
        h.release.set()
        for t in threading.enumerate():
            if t.name == "stub[0]":
                t.join(10)


def test_stuck_thread_after_abort_raises_process_stuck_naming_it(caplog):
    """Regression: a process stuck outside any channel call made run() die with
    a bare CspError. Invariant: after an abort, a thread still alive join_timeout_s later gives
    ProcessStuck whose one-line message and ``processes`` name it; its stack goes to the
    csp.runtime.stack logger, not into the message."""
    h = Harness()
    g = csp.Graph().channel("a", capacity=4)
    g.process("src", Source, outputs={"out": "a"})
    g.process("stub", Stubborn, inputs={"inp": "a"})
    rt = csp.Runtime(g, app=h, join_timeout_s=0.2)
    driver = in_thread(lambda: (h.full.wait(20), rt.abort()))
    try:
        with pytest.raises(csp.ProcessStuck) as info:
            rt.run()
        assert info.value.processes == ["stub[0]"] and info.value.timeout_s == 0.2
        message = str(info.value)
        assert "\n" not in message and message.startswith("process stub[0] did not stop within 0.2 s")
        stacks = [r for r in caplog.records if r.name == "csp.runtime.stack"]
        assert len(stacks) == 1 and "release.wait" in stacks[0].getMessage()  # where it is stuck
    finally:
        h.release.set()
        driver.join(10)
        for t in threading.enumerate():
            if t.name == "stub[0]":
                t.join(10)


CLI_RELEASE = threading.Event()  # lets CliStuck return (set by the test)
CLI_STUCK = threading.Event()  # CliStuck is inside its wait
CLI_SAW_STOP = threading.Event()  # CliTicker saw the graceful stop


class CliTicker(csp.Process):
    """Sends until stopped; for the csp.run CLI, which passes no app."""

    outputs = {"out": int}

    def run(self, inputs, outputs):
        i = 0
        while not self.ctx.stopping():
            try:
                outputs["out"].send_nowait(i)
                i += 1
            except csp.WouldBlock:
                CLI_STUCK.wait(0.001)  # the sink reads nothing: poll stopping() (bounded, not ordering)
        CLI_SAW_STOP.set()


class CliStuck(csp.Process):
    """Waits outside any channel call (as a user stage in time.sleep or a hung collective)."""

    inputs = {"inp": int}

    def run(self, inputs, outputs):
        CLI_STUCK.set()
        assert CLI_RELEASE.wait(30)


def test_csp_run_cli_stuck_process_is_one_line_and_exit_3(tmp_path, capsys, monkeypatch):
    """Regression: Ctrl-C starts a drain the stuck process never finishes, the
    second Ctrl-C aborts, and after the join timeout csp.run died with an uncaught CspError
    traceback, exit 1. Invariant: one 'error:' line naming the process, exit code 3 (EXIT_STUCK,
    documented in --help)."""
    import csp.run
    import csp.runtime.engine

    monkeypatch.setattr(csp.runtime.engine, "JOIN_TIMEOUT_S", 0.2)
    graph = tmp_path / "g.toml"
    graph.write_text('[[channel]]\nname = "a"\ncapacity = 2\n\n'
                     '[[process]]\nname = "tick"\nkind = "tests.csp.runtime.test_runtime:CliTicker"\noutputs = { out = "a" }\n\n'
                     '[[process]]\nname = "stuck"\nkind = "tests.csp.runtime.test_runtime:CliStuck"\ninputs = { inp = "a" }\n')
    CLI_RELEASE.clear(), CLI_STUCK.clear(), CLI_SAW_STOP.clear()

    def driver():
        assert CLI_STUCK.wait(20)
        os.kill(os.getpid(), signal.SIGINT)
        assert CLI_SAW_STOP.wait(20)  # the first signal was handled; the drain cannot finish...
        os.kill(os.getpid(), signal.SIGINT)  # ...so the second one aborts

    t = in_thread(driver)
    try:
        code = csp.run.main([str(graph), "--allow-imports", "--no-run-dir"])
    finally:
        CLI_RELEASE.set()
        t.join(10)
        for th in threading.enumerate():
            if th.name == "stuck[0]":
                th.join(10)
    assert code == csp.runtime.engine.EXIT_STUCK == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "process stuck[0] did not stop within 0.2 s" in err[0]
    assert "3    a process did not stop" in csp.run.build_parser().format_help()


# -- graceful stop and abort ------------------------------------------------------------------

@pytest.mark.parametrize("relay_cls", [Relay, AsyncRelay])
def test_request_stop_drains_in_flight_items(relay_cls, tmp_path):
    """Invariant: after a graceful stop every item the source sent reaches the sink."""
    h = Harness()
    rt = csp.Runtime(pipeline(sink={"wait_release": True}, relay_cls=relay_cls), run_dir=tmp_path, app=h)
    in_flight_at_stop: list[int] = []

    def driver():
        assert h.full.wait(20)  # every channel is full: items are in flight
        in_flight_at_stop.append(len(h.sent) - len(h.received))
        rt.request_stop()
        h.release.set()

    t = in_thread(driver)
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code) == ("stopped", 130)
    assert in_flight_at_stop[0] >= 4
    assert h.saw_stop.is_set() and sorted(h.received) == sorted(h.sent) == list(range(len(h.sent)))
    assert read_stats(tmp_path)[-1]["status"] == "stopped"


def test_sigint_drains_then_restores_handler():
    h = Harness()
    before = signal.getsignal(signal.SIGINT)
    rt = csp.Runtime(pipeline(sink={"wait_release": True}), app=h)

    def driver():
        assert h.full.wait(20)
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: h.contexts[0].stopping())  # the handler ran
        h.release.set()

    t = in_thread(driver)
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code) == ("stopped", 130)
    assert sorted(h.received) == list(range(len(h.sent))) and len(h.sent) >= 4
    assert signal.getsignal(signal.SIGINT) is before


def test_a_long_drain_says_what_it_waits_for(monkeypatch, caplog):
    """A graceful stop that takes a while is never silent: every DRAIN_REPORT_S a line names the
    processes still running, until the drain ends (then no more lines)."""
    import csp.runtime.engine as engine

    monkeypatch.setattr(engine, "DRAIN_REPORT_S", 0.2)
    h = Harness()
    rt = csp.Runtime(pipeline(sink={"wait_release": True}), app=h)

    def driver():
        assert h.full.wait(20)
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: sum("draining:" in r.getMessage() for r in caplog.records) >= 2)
        h.release.set()

    caplog.set_level(logging.WARNING, logger="csp.runtime")
    t = in_thread(driver)
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code) == ("stopped", 130)
    lines = [r.getMessage() for r in caplog.records if "draining:" in r.getMessage()]
    assert "sink" in lines[0] and "still running" in lines[0] and "Ctrl-C again aborts" in lines[0]
    after = len(lines)
    time.sleep(0.6)
    assert sum("draining:" in r.getMessage() for r in caplog.records) == after  # none once drained


def test_second_sigint_aborts():
    h = Harness()
    rt = csp.Runtime(pipeline(src={"ignore_stop": True}), app=h)

    def driver():
        assert h.full.wait(20)
        os.kill(os.getpid(), signal.SIGINT)
        assert h.saw_stop.wait(20)  # the source ignores the graceful stop...
        os.kill(os.getpid(), signal.SIGINT)  # ...so a second Ctrl-C aborts

    t = in_thread(driver)
    t0 = time.perf_counter()
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code) == ("aborted", 130)
    assert time.perf_counter() - t0 < 20
    assert sorted(h.torn_down) == sorted(ALL)


def test_sigterm_drains_then_restores_handler():
    """Regression: SIGTERM (docker stop, SLURM preemption, torchrun's agent) killed the run at
    once. Invariant: it is a graceful stop like the first Ctrl-C: every sent item drains, exit 130,
    and the previous SIGTERM handler is back afterwards."""
    h = Harness()
    before = signal.getsignal(signal.SIGTERM)
    rt = csp.Runtime(pipeline(sink={"wait_release": True}), app=h)

    def driver():
        assert h.full.wait(20)
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: h.contexts[0].stopping())  # the handler ran
        h.release.set()

    t = in_thread(driver)
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code, result.stopped_by) == ("stopped", 130, "SIGTERM")
    assert sorted(h.received) == list(range(len(h.sent))) and len(h.sent) >= 4
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_then_sigint_aborts():
    """A second stop signal of either kind aborts."""
    h = Harness()
    rt = csp.Runtime(pipeline(src={"ignore_stop": True}), app=h)

    def driver():
        assert h.full.wait(20)
        os.kill(os.getpid(), signal.SIGTERM)
        assert h.saw_stop.wait(20)  # the source ignores the graceful stop...
        os.kill(os.getpid(), signal.SIGINT)  # ...so the second signal aborts

    t = in_thread(driver)
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code) == ("aborted", 130)
    assert result.stopped_by == "SIGINT"  # RunResult says which signal ended the run
    assert sorted(h.torn_down) == sorted(ALL)


def test_abort_from_another_thread():
    h = Harness()
    rt = csp.Runtime(pipeline(src={"ignore_stop": True}, relay_cls=AsyncRelay), app=h)

    def driver():
        assert h.full.wait(20)
        rt.abort()

    t = in_thread(driver)
    result = rt.run()
    t.join(10)
    assert (result.status, result.exit_code) == ("aborted", 130)
    assert result.stopped_by == "abort"  # Runtime.abort(), not a signal
    assert sorted(h.torn_down) == sorted(ALL)


def test_live_statistics_show_backpressure():
    """With the sink held (after its first item), the source ends up blocked on its output and
    the sink counts as busy."""
    h = Harness()
    rt = csp.Runtime(pipeline(sink={"wait_release": True}), app=h)
    seen: dict[str, str] = {}

    def driver():
        assert h.full.wait(20)
        def states() -> dict[str, str]:
            return {q: p.state for q, p in rt.statistics()["processes"].items()}

        wait_for(lambda: states()["src[0]"] == "blocked_output" and states()["sink[0]"] != "setup")
        seen.update(states())
        rt.request_stop()
        h.release.set()

    t = in_thread(driver)
    rt.run()
    t.join(10)
    assert seen["src[0]"] == "blocked_output" and seen["sink[0]"] == "busy"


# -- devices ----------------------------------------------------------------------------------

class DeviceProbe(csp.Process):
    """Records, in setup and run, which CUDA device and stream are current in its thread."""

    inputs = {"inp": int}

    def _probe(self, where):
        import torch

        self.ctx.app.contexts.append((where, self.ctx.replica, torch.cuda.current_device(),
                                      torch.cuda.current_stream(), self.ctx.stream,
                                      torch.cuda.default_stream(self.ctx.device)))

    def setup(self):
        self._probe("setup")

    def run(self, inputs, outputs):
        self._probe("run")
        for _ in inputs["inp"]:
            pass


@pytest.mark.gpu
def test_cuda_process_runs_with_its_device_and_own_stream():
    """A process bound to cuda:N runs setup and run with device N current and its own,
    non-default stream current (in its own thread)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = min(torch.cuda.device_count(), 2)
    h = Harness()
    g = csp.Graph().channel("a", capacity=2)
    g.process("src", Source, outputs={"out": "a"}, options={"n": 10})
    g.process("probe", DeviceProbe, inputs={"inp": "a"}, replicas=n,
              devices=[f"cuda:{i}" for i in range(n)])
    csp.Runtime(g, app=h).run()
    probes = [c for c in h.contexts if isinstance(c, tuple)]
    assert len(probes) == 2 * n
    for where, replica, current, stream, own, default in probes:
        assert current == replica, where
        assert stream == own and stream != default, where


def test_a_process_sees_the_runs_live_statistics_through_its_context():
    """ctx.statistics() is the Runtime's live statistics (no callback wired by the caller): a sink
    reading it mid-run sees its own input channel and the items already through it; outside a
    Runtime it is empty."""
    import csp

    seen = {}

    class Src(csp.Process):
        outputs = {"out": int}

        def run(self, inputs, outputs):
            for i in range(5):
                outputs["out"].send(i)

    class Sink(csp.Process):
        inputs = {"inp": int}

        def run(self, inputs, outputs):
            for n, _ in enumerate(inputs["inp"], 1):
                if n == 3:
                    seen.update(self.ctx.statistics()["channels"])

    g = csp.Graph()
    g.channel("c", capacity=2)
    g.process("src", Src, outputs={"out": "c"})
    g.process("sink", Sink, inputs={"inp": "c"})
    csp.Runtime(g).run()
    assert set(seen) == {"c"} and seen["c"].items_moved >= 3
    assert csp.Context("alone").statistics() == {"channels": {}, "processes": {}}
