"""csp.inspect / csp.observe.backpressure: exact parsing of recorded stats logs, the bottleneck rule, and
synthetic graphs run with the real runtime whose bottleneck is known by construction."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

import csp
from csp.inspect import follow, main, render_plain, report
from csp.observe.backpressure import StatsFormatError, StatsReader, read_stats, summarize

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "runs"


# --------------------------------------------------------------------------------------------
# Recorded stats file, numbers computed by hand (see tests/fixtures/runs/pipeline/csp/stats.jsonl:
# source -> batches(cap 4) -> work x2 -> out(cap 2) -> sink; snapshots at t=1 s and final t=2 s).


def test_recorded_stats_whole_run_exact():
    s = report(FIXTURES / "pipeline")
    assert (s.t_start, s.t_end, s.elapsed_s, s.samples) == (0.0, 2.0, 2.0, 2)
    assert (s.status, s.exit_code) == ("completed", 0)
    batches, out = s.channels
    assert batches.name == "batches" and batches.writers == ["source"] and batches.readers == ["work"]
    # fill now = final current_fill; avg = mean(4, 2); peak = final peak_fill
    assert (batches.capacity, batches.fill_now, batches.fill_avg, batches.fill_peak) == (4, 2, 3.0, 4)
    assert batches.send_blocked_frac == pytest.approx(1.5 / (2.0 * 1))  # 1 sender replica
    assert batches.receive_wait_frac == pytest.approx(0.2 / (2.0 * 2))  # 2 receiver replicas
    assert (batches.items_per_s, batches.bytes_per_s) == (10.0, 1000.0)
    assert (out.fill_now, out.fill_avg, out.fill_peak) == (1, 0.5, 2)
    assert out.send_blocked_frac == 0.0
    assert out.receive_wait_frac == pytest.approx(1.6 / 2.0)
    assert out.items_per_s == pytest.approx(9.5)

    source, work, sink = s.processes
    assert [p.name for p in s.processes] == ["source", "work", "sink"]
    assert (source.busy_frac, source.wait_input_frac, source.blocked_output_frac) == (0.25, 0.0, 0.75)
    w0, w1 = work.replicas
    assert w0.qualname == "work[0]" and w0.busy_frac == pytest.approx(0.95)
    assert (w1.busy_frac, w1.wait_input_frac, w1.blocked_output_frac) == pytest.approx((0.85, 0.1, 0.05))
    # aggregate = summed seconds / summed alive seconds: (1.9+1.7)/4, (0.1+0.2)/4, 0.1/4
    assert (work.busy_frac, work.wait_input_frac, work.blocked_output_frac) == pytest.approx((0.9, 0.075, 0.025))
    assert (work.items_in_per_s, work.items_out_per_s) == (10.0, 10.0)
    assert sink.items_in_per_s == pytest.approx(9.5) and sink.wait_input_frac == pytest.approx(0.8)
    assert s.verdict.text == "bottleneck: work (busy 90%; sink waits 80% on 'out'; source blocked 75% on 'batches')"
    assert (s.verdict.stage, s.verdict.replica) == ("work", None)


def test_recorded_stats_window_uses_last_seconds_only():
    s = report(FIXTURES / "pipeline", window_s=1.0)
    assert (s.t_start, s.elapsed_s, s.samples) == (1.0, 1.0, 1)
    batches = s.channels[0]
    assert (batches.fill_avg, batches.fill_peak) == (2.0, 2)  # only the final sample is in the window
    assert batches.send_blocked_frac == pytest.approx(1.0)
    assert batches.receive_wait_frac == pytest.approx(0.05)
    source = s.processes[0]
    assert (source.busy_frac, source.blocked_output_frac) == (0.0, 1.0)


def test_plain_and_json_cli(capsys):
    assert main([str(FIXTURES / "pipeline")]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[1].startswith("bottleneck: work")
    assert any(line.split()[:6] == ["batches", "4", "2", "3.0", "4", "75%"] for line in lines)
    assert any(line.split()[:5] == ["work[1]", "done", "85%", "10%", "5%"] for line in lines)
    assert "\x1b[" not in text  # not a terminal: no escape codes
    assert main([str(FIXTURES / "pipeline"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"]["stage"] == "work"
    assert data["channels"][1]["receive_wait_frac"] == pytest.approx(0.8)


def test_missing_run_dir_exits_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no stats log at" in capsys.readouterr().err


def test_malformed_line_names_file_and_line(tmp_path):
    src = (FIXTURES / "pipeline" / "csp" / "stats.jsonl").read_text().splitlines()
    bad = tmp_path / "stats.jsonl"
    bad.write_text(src[0] + "\n" + '{"kind": "snapshot", "t": "soon"}\n')
    with pytest.raises(StatsFormatError, match=r"stats.jsonl:2: .*\$\.t"):
        read_stats(bad)


@pytest.mark.parametrize("content", [b"[run]\nname = 'x'\n", b"just some text", b"\xff\xfe\x00binary\n",
                                     b'{"kind": "start", "step": 0}\n', b'{"traceEvents": []}'],
                         ids=["toml graph", "text", "binary", "other jsonl", "trace"])
def test_a_file_that_is_not_a_stats_log_is_named_with_what_to_give(tmp_path, capsys, content):
    """Invariant: csp.inspect given a file that is not a stats log (a graph file, text, a trace,
    another JSON log) exits 2 with one line naming the file and what it reads instead; it was
    "JSON is malformed", or an empty "live" report."""
    path = tmp_path / "thing"
    path.write_bytes(content)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{path} is not a csp stats log" in err and "give a run directory" in err, err


def test_crashed_run_half_line_and_no_final(tmp_path):
    """A writer killed mid-line leaves a half record: the rest is still analysed, status is live."""
    src = (FIXTURES / "pipeline" / "csp" / "stats.jsonl").read_text().splitlines()
    path = tmp_path / "csp" / "stats.jsonl"
    path.parent.mkdir()
    path.write_text(src[0] + "\n" + src[1] + "\n" + src[2][:40])
    log = read_stats(tmp_path)
    assert log.truncated_tail and log.final is None and len(log.samples) == 1
    s = summarize(log)
    assert s.status is None and s.t_end == 1.0
    assert "live (no final record)" in render_plain(s)


def test_incremental_feed_keeps_partial_lines():
    text = (FIXTURES / "pipeline" / "csp" / "stats.jsonl").read_text()
    log = StatsReader()
    cut = text.index("\n", text.index("\n") + 1) + 25  # inside the 3rd line
    assert log.feed(text[:cut]) == 2
    assert log.final is None
    assert log.feed(text[cut:]) == 1
    assert log.final is not None and log.final.status == "completed"


def test_no_snapshot_yet():
    log = StatsReader()
    log.feed((FIXTURES / "pipeline" / "csp" / "stats.jsonl").read_text().splitlines()[0] + "\n")
    assert summarize(log).verdict.text == "bottleneck: unknown (no stats snapshot yet)"


def test_follow_tails_until_final(tmp_path):
    """--follow on a non-terminal prints a verdict line per new record and stops at the final one;
    the injected sleep appends the next line, standing in for the live writer."""
    lines = (FIXTURES / "pipeline" / "csp" / "stats.jsonl").read_text().splitlines(keepends=True)
    path = tmp_path / "csp" / "stats.jsonl"
    pending = list(lines)
    sleeps = []

    def fake_sleep(s: float) -> None:
        sleeps.append(s)
        if pending:
            path.parent.mkdir(exist_ok=True)
            with path.open("a") as f:
                f.write(pending.pop(0))

    out = io.StringIO()
    summary = follow(tmp_path, interval=0.5, out=out, sleep=fake_sleep)
    assert summary.status == "completed" and not pending
    text = out.getvalue()
    assert "[t=1.0s] bottleneck:" in text and "[t=2.0s] bottleneck: work" in text
    assert set(sleeps) == {0.5}


def test_follow_ends_at_a_final_record_without_a_newline(tmp_path):
    """A finished log whose last line lacks its newline (saved by an editor, copied) still ends
    --follow at its final record instead of waiting forever; a half-written record is waited for."""
    text = (FIXTURES / "pipeline" / "csp" / "stats.jsonl").read_text().rstrip("\n")
    path = tmp_path / "stats.jsonl"
    cut = len(text) - 10
    path.write_text(text[:cut])  # the last record half written
    sleeps = []

    def fake_sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 3:
            with path.open("a") as f:
                f.write(text[cut:])  # the rest of it, and still no newline
        if len(sleeps) > 20:
            raise AssertionError("--follow did not end at the final record")

    out = io.StringIO()
    summary = follow(path, interval=0.1, out=out, sleep=fake_sleep)
    assert summary.status == "completed"
    assert 3 <= len(sleeps) <= 4


def test_follow_on_a_text_file_without_a_newline_says_it_is_not_a_stats_log(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("some notes, no newline")

    def fake_sleep(s: float) -> None:
        raise AssertionError("--follow waited on a file that is not a stats log")

    with pytest.raises(StatsFormatError, match="not a"):
        follow(path, interval=0.1, out=io.StringIO(), sleep=fake_sleep)


# --------------------------------------------------------------------------------------------
# Synthetic graphs on the real runtime. "Work" is time.sleep(delay) per item: it stands for a
# stage's compute without loading the 2 shared CPU cores (ordering never relies on it).
# Why these cannot flake on a loaded machine: a sleep never returns early, so load only lengthens
# the slow stage's busy time and the others' waits; every assertion is a lower bound on those (the
# slow stage sleeps 10-50 ms per item, the others run microseconds of Python per item, so a starved
# thread would need ~100x its own work in lost CPU to change a verdict). Checked with 4 busy-loop
# processes on 2 cores: test_inspect.py and test_dist.py passed 3 runs in 3.

N_ITEMS = 60


class _Opts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    delay_s: float = 0.0
    slow_replica: int = -1  # only this replica is slow (-1: all replicas use delay_s)
    slow_every: int = 0  # > 0: only items i with i % slow_every == 0 are slow, whichever replica gets them
    ordered: bool = False


def _work(opts: _Opts, replica: int, item: int = 0) -> None:
    if opts.slow_every and item % opts.slow_every:
        return
    if opts.delay_s and opts.slow_replica in (-1, replica):
        time.sleep(opts.delay_s)


class Source(csp.Process):
    Options = _Opts
    outputs = {"out": int}

    def run(self, inputs, outputs):
        for i in range(N_ITEMS):
            _work(self.options, self.ctx.replica)
            outputs["out"].send(i)


class Middle(csp.Process):
    Options = _Opts
    inputs = {"inp": int}
    outputs = {"out": int}

    def run(self, inputs, outputs):
        for i in inputs["inp"]:
            _work(self.options, self.ctx.replica, i)
            outputs["out"].send(i, seq=i if self.options.ordered else None)


class Sink(csp.Process):
    Options = _Opts
    inputs = {"inp": int}

    def run(self, inputs, outputs):
        for _ in inputs["inp"]:
            _work(self.options, self.ctx.replica)


# A slow replica's work per item must be several times the cost of the hand-offs around it, which on
# a loaded machine includes waiting for the GIL: with 20 ms of work and three Python threads spinning
# in the same process (as threads left by earlier tests can), the slow replica measured 34-79% busy
# and the verdict fell to "none clear" below the 50% floor; with 80 ms, 100% every time.
def _run_pipeline(tmp_path: Path, *, source: float = 0.0, middle: float = 0.0, sink: float = 0.0,
                  replicas: int = 1, slow_replica: int = -1, ordered: bool = False, slow_every: int = 0):
    graph = csp.Graph(trace=csp.TraceSpec(stats_interval_s=0.05, perfetto=False))
    graph.channel("a", capacity=4).channel("b", capacity=4, ordered=ordered)
    graph.process("source", Source, outputs={"out": "a"}, options={"delay_s": source})
    graph.process("middle", Middle, inputs={"inp": "a"}, outputs={"out": "b"}, replicas=replicas,
                  options={"delay_s": middle, "slow_replica": slow_replica, "ordered": ordered,
                           "slow_every": slow_every})
    graph.process("sink", Sink, inputs={"inp": "b"}, options={"delay_s": sink})
    result = csp.Runtime(graph, run_dir=tmp_path).run()
    assert result.status == "completed"
    return report(tmp_path)


def test_slow_source_is_the_bottleneck(tmp_path):
    s = _run_pipeline(tmp_path, source=0.01)
    assert s.verdict.stage == "source", s.verdict.text
    assert s.verdict.text.startswith("bottleneck: source (busy")
    assert "middle waits" in s.verdict.text  # everyone downstream waits


def test_slow_middle_is_the_bottleneck(tmp_path):
    s = _run_pipeline(tmp_path, middle=0.01)
    assert s.verdict.stage == "middle", s.verdict.text
    assert "sink waits" in s.verdict.text and "source blocked" in s.verdict.text


def test_slow_sink_is_the_bottleneck(tmp_path):
    s = _run_pipeline(tmp_path, sink=0.01)
    assert s.verdict.stage == "sink", s.verdict.text
    assert "middle blocked" in s.verdict.text  # everyone upstream is blocked
    assert s.channels[0].send_blocked_frac > 0.5 and s.channels[1].fill_peak == 4


def test_one_slow_replica_is_named(tmp_path):
    """Ordered fan-in after 3 replicas: the slow one holds the order, its siblings block on
    output; the verdict names middle[1], not just the stage."""
    s = _run_pipeline(tmp_path, middle=0.08, replicas=3, slow_replica=1, ordered=True)
    assert (s.verdict.stage, s.verdict.replica) == ("middle", "middle[1]"), s.verdict.text
    assert s.verdict.text.startswith("bottleneck: middle[1] (slow replica of middle")


def test_late_item_in_an_ordered_channel_is_head_of_line_blocking(tmp_path):
    """Regression: head-of-line blocking gave "bottleneck: none clear". Invariant: when every 4th item
    is slow, whichever of 3 replicas gets it, the sink waits on the ordered channel 'b' while later
    items sit in it; the verdict names 'b' as holding everyone back, not a stage."""
    s = _run_pipeline(tmp_path, middle=0.05, replicas=3, ordered=True, slow_every=4)
    b = s.channels[1]
    assert b.ordered and b.head_of_line_frac >= 0.2, b
    assert s.verdict.channel == "b", s.verdict.text
    assert "head-of-line on ordered channel 'b': the next item in sequence is late; sink waits" in s.verdict.text


def test_head_of_line_verdict_from_averages_when_no_stage_is_busy():
    """Regression, the numbers of examples/text_pipeline.toml on a slower machine: 'tokens' (ordered) 53/64
    full, senders blocked 72%, receivers waiting 50%, no stage busy half the time. Receivers waited
    50% and the buffer was non-empty >= 83% of the time, so both held >= 33%: only an ordered channel
    can do that. Invariant: the verdict names 'tokens' instead of "none clear"; with a slow replica
    among its writers, it names that replica."""
    from csp.observe.backpressure import (
        ChannelSummary,
        GraphInfo,
        ProcessSummary,
        ReplicaSummary,
        Summary,
        find_bottleneck,
    )

    def rep(name, r, busy, wait, blocked, out=100.0):
        return ReplicaSummary(qualname=f"{name}[{r}]", name=name, replica=r, state="done", alive_s=1.0,
                              busy_frac=busy, wait_input_frac=wait, blocked_output_frac=blocked,
                              items_in_per_s=out, items_out_per_s=out)

    def proc(name, reps):
        return ProcessSummary(name=name, replicas=reps, busy_frac=max(r.busy_frac for r in reps),
                              wait_input_frac=0.0, blocked_output_frac=0.0, items_in_per_s=0.0,
                              items_out_per_s=sum(r.items_out_per_s for r in reps))

    def chan(name, w, r, cap, fill, blocked, wait, ordered=False):
        return ChannelSummary(name=name, capacity=cap, writers=[w], readers=[r], fill_now=0, fill_avg=fill,
                              fill_peak=cap, send_blocked_frac=blocked, receive_wait_frac=wait,
                              items_per_s=1.0, bytes_per_s=0.0, ordered=ordered)

    def verdict(tokenize):
        channels = [chan("lines", "read", "tokenize", 64, 40.0, 0.6, 0.05),
                    chan("tokens", "tokenize", "count", 64, 53.0, 0.72, 0.50, ordered=True),
                    chan("counts", "count", "merge", 4, 0.0, 0.0, 0.97)]
        procs = [proc("read", [rep("read", 0, 0.2, 0.0, 0.8)]), proc("tokenize", tokenize),
                 proc("count", [rep("count", 0, 0.45, 0.55, 0.0)]), proc("merge", [rep("merge", 0, 0.0, 1.0, 0.0)])]
        s = Summary(t_start=0.0, t_end=1.0, elapsed_s=1.0, samples=10, status="completed", exit_code=0,
                    channels=channels, processes=procs, verdict=None)
        return find_bottleneck(s, GraphInfo())

    v = verdict([rep("tokenize", 0, 0.1, 0.1, 0.8), rep("tokenize", 1, 0.12, 0.1, 0.78)])
    assert (v.channel, v.stage, v.replica) == ("tokens", None, None)
    assert v.text.startswith("bottleneck: ordered channel 'tokens' holds everyone back (head-of-line")
    assert "count waits 50% of the time while it holds 53/64 items" in v.text
    assert "tokenize blocked 72% sending items ahead of it" in v.text
    assert "no single replica of tokenize is slower" in v.text
    v = verdict([rep("tokenize", 0, 0.1, 0.1, 0.8), rep("tokenize", 1, 0.9, 0.1, 0.0, out=20.0),
                 rep("tokenize", 2, 0.12, 0.1, 0.78)])
    assert (v.channel, v.stage, v.replica) == ("tokens", "tokenize", "tokenize[1]")
    assert v.text.startswith("bottleneck: tokenize[1] (slow replica of tokenize: busy 90%")


def test_follow_a_live_run(tmp_path):
    """--follow on a graph that is running right now: verdict lines while it runs, and it returns
    by itself once the runtime writes the final record (polling every 20 ms)."""
    result = {}
    runner = threading.Thread(target=lambda: result.update(
        s=_run_pipeline(tmp_path, middle=0.01)), daemon=True)
    runner.start()
    out = io.StringIO()
    summary = follow(tmp_path, interval=0.02, out=out)
    runner.join(timeout=30)
    assert summary.status == "completed" and summary.verdict.stage == "middle"
    verdict_lines = [line for line in out.getvalue().splitlines() if line.startswith("[t=")]
    assert len(verdict_lines) >= 2  # at least one snapshot before the final record
    assert result["s"].verdict.stage == "middle"


@pytest.mark.skipif(sys.platform == "win32", reason="uses a POSIX subprocess")
def test_module_entry_point_runs(tmp_path):
    shutil.copytree(FIXTURES / "pipeline", tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "csp.inspect", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].startswith("bottleneck: work")


def test_threads_not_leaked_by_follow(tmp_path):
    """follow() on a finished log returns at once and leaves no thread behind."""
    shutil.copytree(FIXTURES / "pipeline", tmp_path / "run")
    before = threading.active_count()
    follow(tmp_path / "run", out=io.StringIO(), sleep=lambda s: pytest.fail("should not sleep"))
    assert threading.active_count() == before


def test_window_zero_is_a_usage_error_not_a_traceback(capsys):
    """Regression: ``--window 0`` gave ZeroDivisionError. Invariant: a window
    that is not > 0 is a one-line usage error, exit 2; summarize() itself never divides by an
    empty window."""
    with pytest.raises(SystemExit) as info:
        main([str(FIXTURES / "pipeline"), "--window", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "python -m csp.inspect: error: argument --window: 0 must be > 0"
    s = summarize(read_stats(FIXTURES / "pipeline"), 0.0)
    assert s.samples == 0 and s.channels[0].fill_avg == s.channels[0].fill_now


def test_rates_are_human_readable(capsys):
    """Regression: rates read ``3.7e+04`` items/s. Invariant: SI prefixes (37K items/s, 1.2 GB/s), a
    decimal only below 10, and "-" for bytes of items without tensors instead of "0 B/s"."""
    from csp.observe.units import bytes_rate, count, rate

    assert [count(x) for x in (0, 0.05, 9.5, 41.3, 999.97, 3700, 37_400, 374_000, 1.2e6)] == \
        ["0", "0.05", "9.5", "41", "1.0K", "3.7K", "37K", "374K", "1.2M"]
    assert rate(37_000) == "37K items/s" and rate(2.5, "steps") == "2.5 steps/s"
    assert [bytes_rate(x) for x in (0, 12, 1234, 374e3, 1.2e9)] == \
        ["0 B/s", "12 B/s", "1.2 kB/s", "374 kB/s", "1.2 GB/s"]
    assert main([str(FIXTURES / "pipeline")]) == 0
    out = capsys.readouterr().out
    assert "1.0 kB/s" in out and "e+" not in out
    batches = next(line for line in out.splitlines() if line.startswith("batches"))
    assert batches.split()[-3:] == ["10", "1.0", "kB/s"]
