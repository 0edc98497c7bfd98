"""Observability: stats.jsonl (header, snapshots, final), trace.json (spans, counters, flows),
and tracing off costing nothing (a shared no-op span, no files)."""

from __future__ import annotations

import json
import threading
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

import csp
from csp.core.process import NULL_SPAN
from csp.observe.statslog import StatsWriter
from csp.observe.trace import Tracer

pytestmark = pytest.mark.timeout(30)


class Emit(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        n: int = 20

    outputs = {"out": int}

    def run(self, inputs, outputs):
        for i in range(self.options.n):
            outputs["out"].send(i)


class Double(csp.Process):
    inputs = {"inp": int}
    outputs = {"out": int}

    def run(self, inputs, outputs):
        for v in inputs["inp"]:
            with self.ctx.span("double"):
                outputs["out"].send(2 * v)


class AsyncDouble(Double):
    async def run(self, inputs, outputs):
        async for v in inputs["inp"]:
            with self.ctx.span("double"):
                await outputs["out"].asend(2 * v)


class Collect(csp.Process):
    inputs = {"inp": int}

    def setup(self):
        self.ctx.app["spans"].append(self.ctx.span("x"))

    def run(self, inputs, outputs):
        self.ctx.app["got"].extend(inputs["inp"])


def chain(n: int = 20, trace: csp.TraceSpec | None = None, double: type = Double) -> csp.Graph:
    g = csp.Graph(trace=trace or csp.TraceSpec())
    g.channel("a", capacity=2).channel("b", capacity=2)
    g.process("emit", Emit, outputs={"out": "a"}, options={"n": n})
    g.process("double", double, inputs={"inp": "a"}, outputs={"out": "b"})
    g.process("collect", Collect, inputs={"inp": "b"})
    return g


def run(graph: csp.Graph, run_dir: Path | None, **kw: Any) -> dict[str, Any]:
    app: dict[str, Any] = {"got": [], "spans": []}
    csp.Runtime(graph, run_dir=run_dir, app=app, **kw).run()
    return app


def test_stats_jsonl_header_and_final(tmp_path):
    run(chain(20), tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "csp" / "stats.jsonl").read_text().splitlines()]
    header, final = lines[0], lines[-1]
    assert header["kind"] == "header" and abs(header["t0"] - time.time()) < 60
    assert header["graph"]["channels"] == [{"name": "a", "capacity": 2, "ordered": False},
                                           {"name": "b", "capacity": 2, "ordered": False}]
    assert header["graph"]["processes"][1] == {"name": "double", "replicas": 1,
                                               "inputs": {"inp": "a"}, "outputs": {"out": "b"}, "devices": [None]}
    assert header["host"] == {"cpus": os.cpu_count()}
    assert all(x["kind"] == "snapshot" for x in lines[1:-1])
    assert (final["kind"], final["status"], final["exit_code"]) == ("final", "completed", 0)
    assert final["channels"]["a"]["items_moved"] == 20 and final["channels"]["b"]["capacity"] == 2
    assert set(final["channels"]["a"]) == set(csp.ChannelStatistics.__struct_fields__)
    d = final["processes"]["double[0]"]
    assert set(d) == set(csp.ProcessStatistics.__struct_fields__)
    assert (d["state"], d["items_in"], d["items_out"]) == ("done", 20, 20)
    assert final["t"] > 0


def test_sampler_writes_snapshots_without_blocking(tmp_path):
    """The sampler only reads statistics; it writes snapshot lines on its own period."""
    st = csp.ChannelStatistics(name="a", capacity=1, current_fill=1, peak_fill=1, open_send_ends=1,
                               open_receive_ends=1, waiting_senders=0, waiting_receivers=0,
                               items_moved=3, bytes_moved=0, send_blocked_s=0.0, receive_wait_s=0.0)
    sampled = threading.Event()
    calls = []

    def channels():
        calls.append(1)
        if len(calls) >= 3:
            sampled.set()
        return {"a": st}

    tracer = Tracer()
    log = StatsWriter(tmp_path / "s.jsonl", csp.Graph(), channels, dict, 0.001, tracer)
    log.start()
    assert sampled.wait(10)
    log.close("completed", 0)
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    kinds = Counter(x["kind"] for x in lines)
    assert kinds["header"] == 1 and kinds["final"] == 1 and kinds["snapshot"] >= 2
    assert lines[1]["channels"]["a"]["items_moved"] == 3
    assert [e["args"] for e in tracer.events() if e["ph"] == "C"][0] == {"fill": 1}


@pytest.mark.parametrize("double", [Double, AsyncDouble])
def test_trace_json_spans_counters_tracks(tmp_path, double):
    run(chain(20, double=double), tmp_path)
    doc = json.loads((tmp_path / "csp" / "trace.json").read_text())
    events = doc["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(tracks.values()) == ["collect[0]", "double[0]", "emit[0]"]
    spans = Counter((tracks[e["tid"]], e["name"]) for e in events if e["ph"] == "X")
    for q in tracks.values():
        assert spans[(q, "setup")] == spans[(q, "run")] == spans[(q, "teardown")] == 1
    assert spans[("double[0]", "double")] == 20
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"fill a", "fill b"}
    assert doc["otherData"]["dropped_events"] == 0


def test_flows_follow_sampled_items(tmp_path):
    """Every 5th item of the source starts a flow that steps through double and ends at collect."""
    trace = csp.TraceSpec(flows=True, flow_every=5)
    app = run(chain(20, trace=trace), tmp_path)
    assert sorted(app["got"]) == [2 * i for i in range(20)]
    events = json.loads((tmp_path / "csp" / "trace.json").read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    flows: dict[int, list[tuple[str, str]]] = {}
    for e in sorted((e for e in events if e.get("cat") == "flow"), key=lambda e: e["ts"]):
        flows.setdefault(e["id"], []).append((e["ph"], tracks[e["tid"]]))
    assert len(flows) == 4
    for hops in flows.values():
        assert hops == [("s", "emit[0]"), ("t", "double[0]"), ("t", "double[0]"), ("f", "collect[0]")]


def test_tracing_off_is_free(tmp_path):
    """Trace off: ctx.span is the shared no-op object and no trace file is written."""
    app = run(chain(5), tmp_path, trace=False)
    assert app["spans"] == [NULL_SPAN]
    assert (tmp_path / "csp" / "stats.jsonl").exists()
    assert not (tmp_path / "csp" / "trace.json").exists()
    app = run(chain(5), None)  # no run dir: nothing written, nothing traced
    assert app["spans"] == [NULL_SPAN] and sorted(app["got"]) == [0, 2, 4, 6, 8]


def test_tracer_caps_events_and_records_failing_spans(tmp_path):
    tracer = Tracer(max_events=3)
    with pytest.raises(ValueError):
        with tracer.span(1, "failing"):
            raise ValueError
    for _ in range(4):
        tracer.counter("c", {"v": 1.0})
    assert [e["name"] for e in tracer.events() if e["ph"] != "M"] == ["failing", "c", "c"]
    assert tracer.dropped == 2
    path = tracer.write(tmp_path / "t.json")
    assert json.loads(path.read_text())["otherData"]["dropped_events"] == 2
