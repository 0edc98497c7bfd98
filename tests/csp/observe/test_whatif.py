"""The what-if model (csp.observe.whatif): its arithmetic on a hand-made summary, and its prediction for
the text pipeline checked against a measured run with one more replica."""

from __future__ import annotations

from pathlib import Path

import pytest

import csp
from csp.observe.backpressure import summarize
from csp.observe.stats_reader import read_stats
from csp.observe.whatif import fit, predict, what_if_lines

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 0.2  # sleep-bound stages: oversleeping on a loaded machine is measured, so it cancels


def _run_text_pipeline(run_dir: Path, tokenize_replicas: int):
    """The shipped text pipeline with sleep-bound stages: tokenize 20 ms per line (so 50 lines/s
    per replica), count 8 ms per line (about 125 lines/s), read and merge almost free. Sleeps this
    long keep a loaded machine's oversleep (a millisecond or so per call) small beside them, so the
    bottleneck does not flip from tokenize to count on a busy CPU (it did with 10 and 4 ms)."""
    import examples.textpipe  # noqa: F401  (registers the textpipe.* kinds)

    spec = csp.load_spec(ROOT / "examples" / "text_pipeline.toml", overrides=[
        "process.read.options.generate=300", f"process.tokenize.replicas={tokenize_replicas}",
        "process.tokenize.options.sleep_s=0.02", "process.count.options.sleep_s=0.008",
        "trace.perfetto=false", "trace.flows=false"])
    result = csp.Runtime(csp.Graph.from_spec(spec), run_dir=run_dir).run()
    assert result.status == "completed"
    return summarize(read_stats(run_dir))


def test_one_more_replica_prediction_matches_the_measured_run(tmp_path):
    """Invariant: from a run with 2 tokenize replicas (the bottleneck) the model predicts the
    throughput with 3 and that the bottleneck moves to count; a measured run with 3 replicas lands
    within TOLERANCE of the prediction and its verdict names count."""
    before = _run_text_pipeline(tmp_path / "r2", 2)
    model = fit(before)
    assert model is not None and model.bottleneck == "tokenize"
    predicted, neck = predict(model, {"tokenize": 3})
    assert neck == "count"
    after = _run_text_pipeline(tmp_path / "r3", 3)
    measured = fit(after).measured
    assert abs(measured / predicted - 1) <= TOLERANCE, (predicted, measured, model)
    assert predicted > 1.1 * model.measured  # the prediction is a real gain, not the old figure
    lines = what_if_lines(model)
    assert any(line.startswith("  one more replica of tokenize -> predicted") for line in lines)
    assert any("the bottleneck moves to count at 3 replicas of tokenize" in line for line in lines)


def test_model_arithmetic_on_a_summary():
    """Invariant: capacity = replicas x reference items / busy replica-seconds; the prediction
    scales the measured throughput by the ratio of min capacities, so a non-bottleneck gets +0%;
    a link-bound channel caps it."""
    from csp.observe.backpressure import ChannelSummary, ProcessSummary, ReplicaSummary, Summary, Verdict

    def proc(name, reps, busy, alive, rate_in, rate_out):
        rs = [ReplicaSummary(qualname=f"{name}[{i}]", name=name, replica=i, state="done", alive_s=alive,
                             busy_frac=busy, wait_input_frac=1 - busy, blocked_output_frac=0.0,
                             items_in_per_s=rate_in / reps, items_out_per_s=rate_out / reps) for i in range(reps)]
        return ProcessSummary(name=name, replicas=rs, busy_frac=busy, wait_input_frac=1 - busy,
                              blocked_output_frac=0.0, items_in_per_s=rate_in, items_out_per_s=rate_out)

    # 100 s window, 1000 items: src 10 busy s (cap 100/s), work 2 replicas x 90 busy s
    # (cap 2 x 1000 / 180 = 11.1/s), sink 50 busy s (cap 20/s)
    procs = [proc("src", 1, 0.1, 100, 0, 10), proc("work", 2, 0.9, 100, 10, 10), proc("sink", 1, 0.5, 100, 10, 0)]
    chan = ChannelSummary(name="x", capacity=2, writers=["work"], readers=["sink"], fill_now=0, fill_avg=0,
                          fill_peak=0, send_blocked_frac=0, receive_wait_frac=0, items_per_s=10,
                          bytes_per_s=1e6)
    s = Summary(t_start=0, t_end=100, elapsed_s=100, samples=10, status="completed", exit_code=0,
                channels=[chan], processes=procs, verdict=Verdict(text=""))
    m = fit(s)
    caps = {b.name: b.capacity for b in m.bounds}
    assert m.items == 1000 and m.measured == pytest.approx(10)
    assert caps == pytest.approx({"src": 100, "work": 2000 / 180, "sink": 20})
    assert m.bottleneck == "work"
    assert predict(m, {"sink": 2})[0] == pytest.approx(10)  # not the bottleneck: no gain
    y, neck = predict(m, {"work": 3})
    assert neck == "work" and y == pytest.approx(15)  # 3/2 of the capacity, still below sink's 20
    y, neck = predict(m, {"work": 4})
    assert neck == "sink" and y == pytest.approx(10 * 20 / (2000 / 180))
    assert "the bottleneck moves to sink at 4 replicas of work (predicted 18 items/s, +80%)" in what_if_lines(m)[-1]
    linked = fit(s, link_bytes_per_s={"x": 5e5})  # 1e8 bytes over a 0.5 MB/s link: 200 s for 1000 items
    assert linked.bottleneck == "x" and linked.bounds[0].capacity == pytest.approx(5)
    with pytest.raises(KeyError):
        predict(m, {"nope": 2})


def test_a_replica_that_would_share_busy_hardware_says_so():
    """Invariant: the one-more-replica line keeps its prediction but says when the new replica would
    share hardware the run already kept busy: a stage on "cpu" when the stages on cpu kept more than
    host_cpus - 1 cores busy (a 2-core machine, where an extra drafter replica only takes cores from
    the target), or a stage whose replicas share a GPU (with each other or with other stages); a
    stage alone on its GPU, a host with cores to spare, a log without devices, or a replica
    predicted to gain nothing says nothing."""
    from csp.observe.backpressure import ProcessSummary, ReplicaSummary, Summary, Verdict

    def proc(name, reps, busy, rate_in, rate_out, devices):
        rs = [ReplicaSummary(qualname=f"{name}[{i}]", name=name, replica=i, state="done", alive_s=100,
                             busy_frac=busy, wait_input_frac=1 - busy, blocked_output_frac=0.0,
                             items_in_per_s=rate_in / reps, items_out_per_s=rate_out / reps) for i in range(reps)]
        return ProcessSummary(name=name, replicas=rs, busy_frac=busy, wait_input_frac=1 - busy, blocked_output_frac=0.0,
                              items_in_per_s=rate_in, items_out_per_s=rate_out, devices=devices)

    from csp.observe.whatif import room_note

    def model(cpus, target_dev, drafter_dev):
        procs = [proc("prefetch", 1, 0.05, 0, 10, [None]), proc("target", 2, 0.6, 10, 10, target_dev),
                 proc("drafter", 1, 0.9, 10, 0, drafter_dev)]
        return fit(Summary(t_start=0, t_end=100, elapsed_s=100, samples=10, status="completed", exit_code=0,
                           channels=[], processes=procs, verdict=Verdict(text=""), host_cpus=cpus))

    def lines(cpus, target_dev, drafter_dev):
        return {ln.split(" -> ")[0].split()[-1]: ln for ln in what_if_lines(model(cpus, target_dev, drafter_dev))
                if "one more replica" in ln}

    def notes(target_dev, drafter_dev):
        m = model(2, target_dev, drafter_dev)
        return {b.name: room_note(m, b) for b in m.bounds}

    cpu = lines(2, ["cpu", "cpu"], ["cpu"])   # 2 x 0.6 + 0.9 = 2.1 cores busy of 2
    assert cpu["drafter"].endswith(" (only with a free core: this host has 2 and the stages on cpu kept 2.1 "
                                   "busy, more with torch's own threads)"), cpu["drafter"]
    assert "predicted" in cpu["drafter"] and "(+0%)" in cpu["target"] and "only" not in cpu["target"]  # no gain
    assert "only" not in lines(8, ["cpu", "cpu"], ["cpu"])["drafter"]      # cores to spare
    assert "only" not in lines(0, ["cpu", "cpu"], ["cpu"])["drafter"]       # host not recorded
    gpu = notes(["cuda:0", "cuda:0"], ["cuda:1"])
    assert gpu["target"] == " (only on a GPU of its own: its replicas run on cuda:0)", gpu["target"]
    assert gpu["drafter"] == ""                                             # alone on cuda:1
    shared = notes(["cuda:0", "cuda:1"], ["cuda:1"])
    assert shared["drafter"] == " (only on a GPU of its own: its replicas run on cuda:1 with target)"
    assert lines(2, ["cuda:0", "cuda:1"], ["cuda:1"])["drafter"].endswith(shared["drafter"])
    assert "only" not in lines(2, [], [])["drafter"]                        # a log without devices


def test_the_stats_header_records_devices_and_the_hosts_cores(tmp_path):
    """Invariant: a run's stats header carries each process's devices and the host's CPU count, and
    csp.inspect's summary reads them back (what room_note judges by)."""
    import os

    import examples.textpipe  # noqa: F401  (registers the textpipe.* kinds)

    spec = csp.load_spec(ROOT / "examples" / "text_pipeline.toml", overrides=[
        "process.read.options.generate=20", 'process.count.device="cpu"',
        "trace.perfetto=false", "trace.flows=false"])
    assert csp.Runtime(csp.Graph.from_spec(spec), run_dir=tmp_path).run().status == "completed"
    s = summarize(read_stats(tmp_path))
    devices = {p.name: p.devices for p in s.processes}
    assert devices["count"] == ["cpu"] and devices["read"] == [None]
    assert s.host_cpus == os.cpu_count()
