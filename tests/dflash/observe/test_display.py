"""dflash.observe.display: plain lines when not a terminal, a rich Live view that never blocks, ETA."""

from __future__ import annotations

import io
import threading

import pytest

from csp.core.stats import ChannelStatistics
from dflash.observe.display import LEGEND, TrainingDisplay, format_line, make_display


def _chan(name: str, fill: int, cap: int) -> ChannelStatistics:
    return ChannelStatistics(name=name, capacity=cap, current_fill=fill, peak_fill=cap,
                             open_send_ends=1, open_receive_ends=1, waiting_senders=0,
                             waiting_receivers=0, items_moved=0, bytes_moved=0,
                             send_blocked_s=0.0, receive_wait_s=0.0)


def _rec(step: int, t: float, **kw) -> dict:
    rec = {"kind": "train", "step": step, "window": 10, "loss": 2.3456, "tau_sim": 3.214, "accepted_sim": 2.214,
           "target_tok_s": 29_800.0, "drafter_tok_s": 51_234.0, "lr": 3e-4, "skipped_total": 0,
           "time": t}
    rec.update(kw)
    return rec


def test_plain_lines_when_not_a_terminal():
    out, log = io.StringIO(), io.StringIO()
    with TrainingDisplay(1000, file=out, log_file=log) as d:
        assert not d.is_live
        d.update(_rec(10, 100.0), [_chan("batches", 3, 8), {"name": "features", "current_fill": 1,
                                                            "capacity": 2}])
        d.update(_rec(20, 110.0, skipped_total=2))
        d.note("checkpoint step 20 saved (1.2 s)")
    lines = out.getvalue().splitlines()
    assert lines == [
        LEGEND,   # once, before the first line: what its figures are
        "step 10/1000 1.0% | loss 2.346 tau 3.21 (accepted 2.21) | target 29.8K tok/s drafter 51.2K tok/s | "
        "lr 3.0e-04 | eta ? | batches 3/8 features 1/2",
        # 10 steps in 10 s -> 980 steps left take 980 s
        "step 20/1000 2.0% | loss 2.346 tau 3.21 (accepted 2.21) | target 29.8K tok/s drafter 51.2K tok/s | "
        "lr 3.0e-04 | skipped 2 | eta 0:16:20",
        "checkpoint step 20 saved (1.2 s)",
    ]
    assert log.getvalue() == out.getvalue()
    assert "\x1b[" not in out.getvalue()


def test_eta_follows_recent_rate_and_clock_fallback():
    now = [0.0]
    d = TrainingDisplay(100, file=io.StringIO(), rate_window=2, clock=lambda: now[0])
    d.update({"step": 10})
    now[0] = 100.0
    d.update({"step": 20})  # 0.1 step/s
    assert d.eta_s() == 800.0
    now[0] = 110.0
    d.update({"step": 30})  # window of 2 updates: now 1 step/s
    assert d.eta_s() == 70.0


def test_make_display_modes_and_mapping_of_channel_stats():
    """The monitor passes ``ctx.statistics()["channels"]``: a dict name -> ChannelStatistics."""
    out, log = io.StringIO(), io.StringIO()
    d = make_display("plain", total_steps=100, file=out)
    d.update(_rec(10, 1.0, spike=True), {"batches": _chan("batches", 2, 4)})
    assert out.getvalue().endswith("| batches 2/4\n") and "loss 2.346 SPIKE tau" in out.getvalue()
    out = io.StringIO()
    with make_display("off", total_steps=100, file=out, log_file=log) as d:
        d.update(_rec(10, 1.0))
        d.note("x")
    logged = log.getvalue().splitlines()
    assert out.getvalue() == "" and logged[0] == LEGEND and logged[1].startswith("step 10/100")  # the log file: both
    with pytest.raises(ValueError, match="display mode 'fancy'"):
        make_display("fancy")


def test_non_finite_and_missing_values_do_not_crash():
    line = format_line({"step": 5, "loss": float("nan"), "target_tok_s": None})
    assert line.startswith("step 5 | loss nan tau None (accepted None) | target - tok/s")


def test_live_view_renders_and_update_is_cheap():
    """Forced Live mode on a string buffer: update() only swaps the renderable (rich's thread
    repaints), and close() stops the refresh thread."""
    out = io.StringIO()
    before = threading.active_count()
    d = TrainingDisplay(1000, file=out, mode="live", refresh_per_second=4, start_step=5)
    assert d.is_live
    for step in range(10, 210, 10):
        d.update(_rec(step, float(step)), [_chan("batches", 3, 8)])
    d.note("checkpoint step 200 saved")
    d.close()
    d.close()  # idempotent
    text = out.getvalue()
    assert "step 200/1000" in text and "batches" in text and "3/8" in text
    assert "checkpoint step 200 saved" in text and "from step 5" in text
    assert threading.active_count() == before


def test_a_window_that_averaged_fewer_steps_says_so():
    """Invariant: a window whose averages leave out skipped steps is labelled
    with how many it averaged; a full window carries no label."""
    partly = format_line(_rec(10, 1.0, window=5, steps_averaged=4, skipped_total=1))
    assert "averaged 4/5 steps" in partly
    assert "averaged" not in format_line(_rec(10, 1.0, window=5, steps_averaged=5))
    out = io.StringIO()
    d = TrainingDisplay(100, file=out, mode="live", refresh_per_second=4)
    d.update(_rec(10, 1.0, window=5, steps_averaged=4))
    d.close()
    assert "averaged 4 of 5 steps" in out.getvalue()
