"""dflash.plot: the PNG of a run's curves, with skips, checkpoints, resumes, gaps and missed held-out
evaluations marked, from metrics.jsonl alone; tolerant of either tau convention being absent."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from dflash.observe.plot import PlotUnavailable, evaluation_gaps, main, make_figure, plot_run, tau_limits

pytest.importorskip("matplotlib", reason="dflash.plot needs matplotlib (the test extra installs it)")


def _train(step: int, t: float, loss: float, **kw) -> dict:
    rec = {"kind": "train", "step": step, "window": 2, "loss": loss, "ce": loss, "kl": 0.0,
           "acc": [0.5 - 0.05 * j for j in range(7)], "lr": 1e-3 * min(step / 10, 1), "grad_norm": 2.0,
           "tok_s": 9000.0, "target_tok_s": 20000.0, "drafter_tok_s": 12000.0, "skipped_total": 0, "time": t}
    rec.update(kw)
    return rec


def history(tau_keys: tuple[str, ...] = ("tau_sim", "accepted_sim")) -> list[dict]:
    """Two segments: steps 2..20 (a skip at 7, checkpoints at 10 (healthy) and 20 (unhealthy), a
    logging gap between 14 and 16, a spike at 12), then a resume from step 10 redoing 12..20."""
    recs: list[dict] = [{"kind": "start", "step": 0, "time": 0.0}]
    t = 0.0
    for step in range(2, 22, 2):
        t += 1.0 if step != 16 else 30.0  # the gap
        kw = {k: (2.0 + step / 20 if k == "tau_sim" and "accepted_sim" in tau_keys else 1.0 + step / 20)
              for k in tau_keys}
        if step == 12:
            kw["spike"] = True
        if step == 8:
            recs.append({"kind": "skip", "step": 7, "batch_id": 6, "reason": "non-finite loss", "time": t})
            kw["skipped_total"] = 1
        recs.append(_train(step, t, 9.0 - step / 10 + (2.0 if step == 12 else 0.0), **kw))
        if step in (10, 20):
            recs.append({"kind": "checkpoint", "step": step, "healthy": step == 10, "save_s": 0.1, "time": t})
    recs += [{"kind": "end", "status": "stopped", "exit_code": 130, "time": t},
             {"kind": "start", "step": 10, "time": t + 5}, {"kind": "resume", "step": 10, "path": "ck", "time": t + 5}]
    for step in range(12, 22, 2):
        t += 1.0
        recs.append(_train(step, t + 5, 8.0 - step / 10, **{k: 2.5 for k in tau_keys}))
    return recs


def write(run: Path, recs: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def _labels(fig) -> set[str]:
    """Every legend entry: the panels' (data lines) and the figure's (event markers)."""
    return ({h for ax in fig.axes for h in ax.get_legend_handles_labels()[1]}
            | {t.get_text() for leg in fig.legends for t in leg.get_texts()})


def test_png_written_with_every_panel_and_every_event_marked(tmp_path):
    """Invariant: the plot shows loss, per-position accuracy, tau (both conventions), lr, grad norm and
    tok/s, and marks skipped steps, checkpoints (healthy or not), resumes, logging gaps and spikes."""
    run = write(tmp_path / "run", history())
    out = plot_run(run)
    assert out == run / "plot.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = make_figure(history(), "run")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss (window mean)", "accuracy per block position", "tau (simulated)",
                      "learning rate", "gradient norm (before clipping)", "throughput (tokens/s)"]
    labels = _labels(fig)
    assert {"skipped step (1)", "checkpoint", "unhealthy checkpoint", "resume", "logging gap", "spike",
            "tau, simulated on training batches", "pos 1", "pos 7",
            "overall", "target", "drafter"} <= labels
    loss_lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label() in ("loss", "_child0", "_child1")
                  or ln.get_color() == "#1f77b4"]
    xs = [list(ln.get_xdata()) for ln in loss_lines if len(ln.get_xdata()) > 1]
    assert [2, 4, 6, 8, 10, 12, 14, 16, 18, 20] in xs and [12, 14, 16, 18, 20] in xs  # one line per segment


@pytest.mark.parametrize("keys, expect, right", [
    (("tau_sim",), {"accepted (tau_sim of an older log)"}, None),
    (("tau_sim", "accepted_sim"), {"tau, simulated on training batches"}, "accepted = tau - 1 (drafts / verify step)")])
def test_either_tau_convention_plots_under_its_meaning(keys, expect, right):
    """Invariant: a log from before tau meant tokens per verify step (tau_sim alone: the accepted
    length) plots as accepted; a new one (tau_sim = accepted_sim + 1) plots tau, and a right-hand
    scale one lower reads the accepted length."""
    fig = make_figure(history(keys))
    labels = _labels(fig)
    every = {"tau, simulated on training batches", "accepted (tau_sim of an older log)"}
    assert expect <= labels and not (every - expect) & labels
    seconds = fig.axes[2].child_axes
    assert [a.get_ylabel() for a in seconds] == ([right] if right else [])
    if right:
        assert seconds[0]._functions[0](1.25) == pytest.approx(0.25)  # the scale reads tau - 1


def realistic(skipped: int = 0, unevaluated: int | None = None) -> list[dict]:
    """A debug run's shape: tau_sim 1.03 -> 1.17 (accepted 0.03 -> 0.17), held-out tau at 200, 400,
    600 (1.10, 1.15, 1.21); ``skipped`` snapshots before the 600 evaluation instead of the 400 one."""
    recs: list[dict] = [{"kind": "start", "step": 0, "time": 0.0}]
    for step in range(25, 625, 25):
        acc = 0.03 + 0.14 * step / 600
        recs.append(_train(step, float(step), 5.0, tau_sim=1 + acc, accepted_sim=acc))
        tau = {200: 1.10, 400: 1.15, 600: 1.21}.get(step)
        if tau is not None and not (skipped and step == 400):
            recs.append({"kind": "heldout", "step": step, "tau": tau, "accepted": tau - 1, "sampled_tau": tau - 0.02,
                         "skipped": skipped if step == 600 else 0})
    recs.append({"kind": "end", "status": "completed" if unevaluated is None else "stopped", "step": 600,
                 "unevaluated": unevaluated})
    return recs


def test_tau_axis_fits_the_data_above_one():
    """Regression: the tau panel's y-axis ran from 0 (the accepted-length line shared it), which
    squashed the simulated and held-out tau (all in 1.03..1.21) into the top fifth. Invariant: the
    axis spans the values with a margin, and its bottom is near 1 (tau >= 1), never near 0."""
    fig = make_figure(realistic())
    ax = fig.axes[2]
    bottom, top = ax.get_ylim()
    assert 0.98 <= bottom <= 1.03 and 1.21 < top <= 1.27
    assert {"held-out tau, measured (draft-and-verify)", "held-out tau, sampled"} <= _labels(fig)
    assert tau_limits([1.5, 1.5]) == pytest.approx((1.45, 1.55))  # one value: a margin of 0.05 tokens
    assert tau_limits([2.0, 4.0]) == pytest.approx((1.8, 4.2))  # far above 1: the data's own margin
    assert tau_limits([0.03, 0.2], floor=0.0)[0] == pytest.approx(-0.0125)  # an older log's accepted length
    assert tau_limits([0.9, 1.2])[0] < 0.9  # a value under 1 (a broken log) still shows


def test_a_tree_figure_is_drawn_with_its_budget_and_fits_the_axis():
    recs = realistic()
    held = [r for r in recs if r.get("kind") == "heldout"]
    for r in held:
        r.update(tree_tau=r["tau"] + 0.6, tree_budget=32)
    fig = make_figure(recs)
    assert "held-out tau, tree of 32" in _labels(fig)
    assert fig.axes[2].get_ylim()[1] > max(r["tree_tau"] for r in held)


def test_the_tau_outside_repetition_loops_is_drawn_only_where_the_decodes_looped():
    """Invariant: a held-out record whose decodes looped adds the tau outside the loops as its own
    line, inside the axis; records that did not loop (share 0) or predate the figure add none."""
    recs = realistic()
    held = [r for r in recs if r.get("kind") == "heldout"]
    assert "held-out tau, outside repetition loops" not in _labels(make_figure(recs))
    for r in held:
        r.update(loop_share=0.0, fresh_tau=r["tau"])
    assert "held-out tau, outside repetition loops" not in _labels(make_figure(recs))
    held[-1].update(loop_share=0.3, fresh_tau=0.9)
    fig = make_figure(recs)
    (line,) = [ln for ln in fig.axes[2].get_lines() if ln.get_label() == "held-out tau, outside repetition loops"]
    assert list(line.get_xdata()) == [held[-1]["step"]] and fig.axes[2].get_ylim()[0] < 0.9


def test_skipped_and_cut_short_evaluations_are_marked():
    """Regression: an evaluation the evaluator skipped (busy, or over eval.max_busy) or that a stop
    cut short left no mark, so the held-out curve looked evenly sampled. Invariant: each is a cross
    on the tau panel at its step, with a legend entry saying which."""
    recs = realistic(skipped=1, unevaluated=600)
    assert evaluation_gaps(recs) == ([400], [600])
    fig = make_figure(recs)
    marks = {ln.get_label(): list(ln.get_xdata()) for ln in fig.axes[2].get_lines()}
    assert marks["held-out evaluation skipped (1)"] == [400]
    assert marks["held-out evaluation cut short by a stop (step 600)"] == [600]
    assert {"held-out evaluation skipped (1)", "held-out evaluation cut short by a stop (step 600)"} <= _labels(fig)
    assert evaluation_gaps(realistic()) == ([], [])
    assert not any("evaluation" in label for label in _labels(make_figure(realistic())))


def test_skipped_evaluations_of_a_resumed_process_count_from_its_start():
    """Invariant: a resumed process's skipped count covers the snapshots since the step it started
    from, so the crosses go between that step and its first evaluation, not before the resume."""
    recs = [{"kind": "start", "step": 0}, {"kind": "heldout", "step": 200, "tau": 1.1, "skipped": 0},
            {"kind": "end", "status": "stopped"}, {"kind": "start", "step": 300},
            {"kind": "heldout", "step": 900, "tau": 1.2, "skipped": 2}]
    assert evaluation_gaps(recs) == ([500, 700], [])


def test_no_tau_at_all_and_null_losses_still_plot():
    recs = [_train(s, float(s), float("nan") if s == 4 else 3.0) for s in (2, 4, 6)]
    for r in recs:
        r["loss"] = None if not math.isfinite(r["loss"]) else r["loss"]
    fig = make_figure(recs)
    assert fig.axes[2].get_title() == "accepted length: not in the log"


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """Invariant: a missing log, an empty log, or no matplotlib: one line on stderr, exit 2."""
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    write(tmp_path, [{"kind": "start", "step": 0}])
    assert main([str(tmp_path)]) == 2
    assert "no train record yet" in capsys.readouterr().err
    write(tmp_path, history())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotUnavailable, match="pip install matplotlib"):
        plot_run(tmp_path)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash.plot: matplotlib is not installed: pip install") and "\n" not in err


def test_cli_writes_the_named_file(tmp_path, capsys):
    write(tmp_path / "run", history())
    assert main([str(tmp_path / "run"), "-o", str(tmp_path / "x" / "curves.png"), "--dpi", "40"]) == 0
    assert (tmp_path / "x" / "curves.png").stat().st_size > 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'x' / 'curves.png'}"


def test_the_plain_install_brings_matplotlib():
    """Regression: ``pip install -e .`` then ``dflash.run`` (the README's first command) wrote no
    plot.png, since matplotlib came only with the test extra. Invariant: it is a core dependency."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("matplotlib>=") for d in project["dependencies"])
