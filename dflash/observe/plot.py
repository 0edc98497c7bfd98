"""``python -m dflash.plot RUN_DIR``: the training curves of a run as one PNG.

Reads ``RUN_DIR/metrics.jsonl`` (every segment: a resumed run continues the same file) and draws,
against the training step, six panels: loss, per-position accuracy (one line per block position),
tau (``tau_sim``: simulated tokens per verify step on the training batches, and the held-out tau
measured by real decoding, ``heldout`` records; its y-axis fits those values, never far below 1,
and a right-hand scale reads the accepted length, tau - 1; in logs older than that convention
``tau_sim`` alone, the accepted length), learning rate, gradient norm, and tokens/s (overall,
target, drafter). Every panel marks:

* skipped steps (red ticks along the bottom; a ``skip`` record each),
* checkpoints (grey dotted lines; red when the checkpoint was not healthy),
* resumes (green dashed lines, labelled with the step resumed from),
* logging gaps (a shaded band between the two windows around the gap, :func:`dflash.observe.logs.find_gaps`),
* loss spikes flagged by the monitor (orange dots on the loss panel),

and the tau panel the held-out evaluations that did not happen (:func:`evaluation_gaps`): skipped
ones (red crosses along its bottom) and one a stop cut short (a dark red cross).

A resumed segment that redoes steps is drawn as its own line over the earlier one. Default
output: ``RUN_DIR/plot.png``. ``dflash.run`` writes it at the end of every run (matplotlib is a
dependency of this package; where it is missing, the run's summary says in one line how to draw it).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from csp._guard import check as _check_owner
from csp.cli import make_parser

_check_owner("dflash", Path(__file__).parent.parent)  # under another distribution's dflash (csp._guard)

EXIT_CODES = {0: "the PNG was written",
              2: "no metrics.jsonl or no train record in RUN_DIR, or matplotlib is not installed"}
INSTALL_HINT = "pip install matplotlib"


class PlotUnavailable(RuntimeError):
    """matplotlib is not importable (the message says how to install it)."""


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _segments(records: list[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Train records split at each ``start`` record (one list per run segment, non-empty)."""
    segs: list[list[Mapping[str, Any]]] = [[]]
    for r in records:
        if r.get("kind") == "start" and segs[-1]:
            segs.append([])
        elif r.get("kind") == "train":
            segs[-1].append(r)
    return [s for s in segs if s]


def _series(train: list[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in train if _finite(r.get(key)) and _finite(r.get("step"))]
    return [p[0] for p in pts], [p[1] for p in pts]


MAX_DPI = 1200
"""The largest ``--dpi`` accepted: a 15 x 8.5 in figure at 1,200 dpi is 18,000 x 10,200 pixels."""


def plot_run(run_dir: str | Path, out: str | Path | None = None, *, dpi: int = 110) -> Path:
    """Write the PNG of ``run_dir``'s curves; returns its path (default ``RUN_DIR/plot.png``).

    Raises:
        PlotUnavailable: matplotlib is not installed.
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        ValueError: the log holds no train record yet.
    """
    _require_matplotlib()
    from dflash.observe.logs import read_metrics

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path}: is {run_dir} a dflash run directory?")
    records, _ = read_metrics(path)
    if not _segments(records):
        raise ValueError(f"{path} holds no train record yet (the first window is logged after "
                         "[monitor].window steps)")
    out = Path(out) if out is not None else run_dir / "plot.png"
    fig = make_figure(records, run_dir.resolve().name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"matplotlib is not installed: {INSTALL_HINT}") from exc


def make_figure(records: list[Mapping[str, Any]], name: str = "run") -> Any:
    """The six-panel matplotlib Figure of ``records`` (metrics.jsonl records, file order: those of
    :mod:`dflash.records`, or dicts with the same keys).

    Raises: PlotUnavailable without matplotlib; ValueError when there is no train record.
    """
    _require_matplotlib()
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from dflash.observe.logs import find_gaps

    segs = _segments(records)
    if not segs:
        raise ValueError("no train record to plot")
    train = [r for s in segs for r in s]
    fig = Figure(figsize=(15, 8.5), layout="constrained")  # no pyplot: no global state, no GUI
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3, sharex=True).ravel()
    last = train[-1]
    loss = last.get("loss")
    fig.suptitle(f"{name}: step {last.get('step')}, loss {format(loss, '.4g') if _finite(loss) else loss} "
                 f"({len(train)} windows, {len(segs)} segment{'s' if len(segs) > 1 else ''})",
                 fontsize=13)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]

    def lines(ax, key: str, label: str, color: str, **kw: Any) -> bool:
        drawn = False
        for i, seg in enumerate(segs):
            xs, ys = _series(seg, key)
            if xs:
                ax.plot(xs, ys, color=color, label=label if not drawn else None,
                        alpha=1.0 if i == len(segs) - 1 else 0.6, **kw)
                drawn = True
        return drawn

    ax = axes[0]
    lines(ax, "loss", "loss", colors[0], lw=1.6)
    if any(_finite(r.get("kl")) and r["kl"] > 0 for r in train):
        lines(ax, "ce", "cross-entropy", colors[1], lw=1, ls="--")
        lines(ax, "kl", "KL", colors[2], lw=1, ls="--")
    spikes = [(r["step"], r["loss"]) for r in train if r.get("spike") and _finite(r.get("loss"))]
    if spikes:
        ax.scatter(*zip(*spikes), color="#ff7f0e", zorder=5, s=30, label="spike")
    ax.set_title("loss (window mean)")

    ax = axes[1]
    width = max((len(r.get("acc") or []) for r in train), default=0)
    cmap = matplotlib.colormaps["viridis"]
    for j in range(width):
        color = _cmap(cmap, j, width)
        for i, seg in enumerate(segs):
            pts = [(r["step"], r["acc"][j]) for r in seg
                   if isinstance(r.get("acc"), list) and len(r["acc"]) > j and _finite(r["acc"][j])]
            if pts:
                ax.plot(*zip(*pts), color=color, lw=1.2, label=f"pos {j + 1}" if i == 0 else None)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("accuracy per block position")

    ax = axes[2]
    tokens = any("accepted_sim" in r for r in train)  # tau_sim = tokens per verify step = accepted_sim + 1
    if tokens:
        simulated = lines(ax, "tau_sim", "tau, simulated on training batches", colors[0], lw=1.6)
    else:  # logs written before tau meant tokens per step: their tau_sim is the accepted length
        simulated = lines(ax, "tau_sim", "accepted (tau_sim of an older log)", colors[1], lw=1.4)
    held = [r for r in records if r.get("kind") == "heldout" and _finite(r.get("tau"))]
    sampled = [r for r in held if _finite(r.get("sampled_tau"))]
    tree = [r for r in held if _finite(r.get("tree_tau"))]
    fresh = [r for r in held if _finite(r.get("fresh_tau")) and r.get("loop_share")]
    if held:  # measured by real decoding on held-out prompts ([eval]): the figure dflash.eval gives
        ax.plot([r["step"] for r in held], [r["tau"] for r in held], "o-", color=colors[2], lw=1.4, ms=4,
                label="held-out tau, measured (draft-and-verify)")
        if sampled:
            ax.plot([r["step"] for r in sampled], [r["sampled_tau"] for r in sampled], "s--", color=colors[5],
                    lw=1.0, ms=3, label="held-out tau, sampled")
        if tree:
            ax.plot([r["step"] for r in tree], [r["tree_tau"] for r in tree], "^:", color=colors[3], lw=1.0, ms=4,
                    label=f"held-out tau, tree of {tree[-1].get('tree_budget')}")
        if fresh:  # the same decodes without their repetition loops' steps (easy to draft)
            ax.plot([r["step"] for r in fresh], [r["fresh_tau"] for r in fresh], "o:", color=colors[2], lw=1.0,
                    ms=3, mfc="none", label="held-out tau, outside repetition loops")
    _mark_evaluations(ax, records)
    values = ([y for s in segs for y in _series(s, "tau_sim")[1]] + [r["tau"] for r in held]
              + [r["sampled_tau"] for r in sampled] + [r["tree_tau"] for r in tree] + [r["fresh_tau"] for r in fresh])
    if values:
        ax.set_ylim(*tau_limits(values, floor=0.0 if simulated and not tokens else 1.0))
    if tokens:  # the accepted length is the same curve one lower: a second scale, not a second line
        right = ax.secondary_yaxis("right", functions=(_minus_one, _plus_one))
        right.set_ylabel("accepted = tau - 1 (drafts / verify step)", fontsize=8)
        ax.set_ylabel("tau (tokens / verify step)", fontsize=8)
    if held:
        ax.set_title("tau: simulated on training batches, measured held out" if simulated else "tau, measured held out")
    else:
        ax.set_title(("tau (simulated)" if tokens else "accepted length (simulated)") if simulated
                     else "accepted length: not in the log")

    ax = axes[3]
    lines(ax, "lr", "lr", colors[3], lw=1.4)
    ax.set_title("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    ax = axes[4]
    lines(ax, "grad_norm", "grad norm", colors[4], lw=1.2)
    ax.set_title("gradient norm (before clipping)")
    norms = [r["grad_norm"] for r in train if _finite(r.get("grad_norm"))]
    if norms and min(norms) > 0 and max(norms) > 30 * min(norms):  # a blow-up: keep the rest visible
        ax.set_yscale("log")

    ax = axes[5]
    lines(ax, "tok_s", "overall", colors[0], lw=1.6)
    lines(ax, "target_tok_s", "target", colors[2], lw=1, ls="--")
    lines(ax, "drafter_tok_s", "drafter", colors[1], lw=1, ls="--")
    ax.set_title("throughput (tokens/s)")
    ax.yaxis.set_major_formatter(_si_formatter())

    events = _mark_events(axes, records, find_gaps)
    if events:
        fig.legend([h for h, _ in events], [lb for _, lb in events], loc="outside lower center",
                   ncol=len(events), fontsize=9, frameon=False)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=8, loc="best", ncol=2 if len(handles) > 5 else 1)
    from matplotlib.ticker import MaxNLocator

    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by every panel
    for ax in axes[3:]:
        ax.set_xlabel("training step")
    return fig


def tau_limits(values: list[float], floor: float = 1.0) -> tuple[float, float]:
    """The tau panel's y-limits (bottom, top) for the plotted ``values`` (tokens per verify step):
    their range with a margin of 10% of it (at least 0.05 tokens) each side, but the bottom at most a
    quarter margin under ``floor``, which no value of that kind goes below (tau >= 1 by definition: the
    target's own token; 0 for an older log's accepted length). A value under ``floor`` stays visible."""
    lo, hi = min(values), max(values)
    pad = max(0.1 * (hi - lo), 0.05)
    bottom = lo - pad if lo < floor else max(lo - pad, floor - pad / 4)
    return bottom, hi + pad


def _minus_one(x: Any) -> Any:
    return x - 1


def _plus_one(x: Any) -> Any:
    return x + 1


def evaluation_gaps(records: list[Mapping[str, Any]]) -> tuple[list[int], list[int]]:
    """The held-out evaluations a run did not finish: ``(skipped, cut_short)``, training steps.

    ``skipped``: snapshots the evaluator passed over (busy, or over ``[eval].max_busy``), which a
    ``heldout`` record counts (its ``skipped``) without their steps; they are placed evenly between
    that evaluation and the one before it in the same process (or the step the process started
    from), which is where they were when snapshots come every ``[eval].every`` steps and the later
    evaluation is one of those (every evaluation but the final weights'). ``cut_short``: the step an
    ``end`` record names ``unevaluated`` (a stop ended or prevented its evaluation).
    """
    skipped: list[int] = []
    cut: list[int] = []
    prev = 0
    for r in records:
        kind = r.get("kind")
        if kind == "start":
            prev = r["step"] if _finite(r.get("step")) else 0
        elif kind == "heldout" and _finite(r.get("step")):
            n, step = r.get("skipped"), r["step"]
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                skipped += [round(prev + (step - prev) * k / (n + 1)) for k in range(1, n + 1)]
            prev = step
        elif kind == "end" and _finite(r.get("unevaluated")):
            cut.append(r["unevaluated"])
    return skipped, cut


def _mark_evaluations(ax: Any, records: list[Mapping[str, Any]]) -> None:
    """Skipped and cut-short held-out evaluations (:func:`evaluation_gaps`) as crosses along the
    bottom of the tau panel, each kind with its legend entry."""
    skipped, cut = evaluation_gaps(records)
    bottom = ax.get_xaxis_transform()  # x in steps, y in axes fraction: independent of the tau scale
    if skipped:
        ax.plot(skipped, [0.05] * len(skipped), ls="none", marker="x", ms=8, mew=2, color="#d62728",
                transform=bottom, label=f"held-out evaluation skipped ({len(skipped)})")
    if cut:
        ax.plot(cut, [0.05] * len(cut), ls="none", marker="X", ms=10, mew=0.5, color="#7f0000",
                transform=bottom, label=f"held-out evaluation cut short by a stop (step {', '.join(map(str, cut))})")


def _cmap(cmap: Any, j: int, n: int) -> Any:
    return cmap(j / max(n - 1, 1) * 0.9)


def _si_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    def fmt(x: float, _pos: Any) -> str:
        for unit, scale in (("M", 1e6), ("K", 1e3)):
            if abs(x) >= scale:
                return f"{x / scale:g}{unit}"
        return f"{x:g}"

    return FuncFormatter(fmt)


def _mark_events(axes: Any, records: list[Mapping[str, Any]], find_gaps: Any) -> list[tuple[Any, str]]:
    """Skips, checkpoints, resumes and logging gaps on every panel; returns the legend entries
    (handle, label) of the kinds present, for one legend under the figure."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    skips = [r["step"] for r in records if r.get("kind") == "skip" and _finite(r.get("step"))]
    ckpts = list({r["step"]: bool(r.get("healthy", True)) for r in records  # a step's last record holds
                  if r.get("kind") == "checkpoint" and _finite(r.get("step"))}.items())
    resumes = [r["step"] for r in records if r.get("kind") == "resume" and _finite(r.get("step"))]
    try:  # a gap across a stop and resume is the resume line itself, not a band
        gaps = [(g.after_step, g.before_step) for g in find_gaps(records)
                if g.after_step < g.before_step and not ({"resume", "restart"} & set(str(g.cause).split()))]
    except Exception:  # noqa: BLE001 - a plot never fails on a log it cannot analyse
        gaps = []
    style = {"checkpoint": dict(color="#7f7f7f", ls=":", lw=1.2),
             "unhealthy checkpoint": dict(color="#d62728", ls=":", lw=1.5),
             "resume": dict(color="#2ca02c", ls="--", lw=1.4)}
    for i, ax in enumerate(axes):
        for step, healthy in ckpts:
            ax.axvline(step, **style["checkpoint" if healthy else "unhealthy checkpoint"])
        for step in resumes:
            ax.axvline(step, **style["resume"])
            if i == 0:
                ax.annotate(f"resumed at {step}", (step, 1), xycoords=("data", "axes fraction"),
                            xytext=(3, -12), textcoords="offset points", fontsize=8, color="#2ca02c")
        for a, b in gaps:
            ax.axvspan(a, b, color="#ffbb78", alpha=0.35, lw=0)
        if skips:
            ax.plot(skips, [0.0] * len(skips), ls="none", marker="|", ms=14, mew=2, color="#d62728",
                    transform=ax.get_xaxis_transform(), clip_on=False)
    legend: list[tuple[Any, str]] = []
    if any(h for _, h in ckpts):
        legend.append((Line2D([], [], **style["checkpoint"]), "checkpoint"))
    if any(not h for _, h in ckpts):
        legend.append((Line2D([], [], **style["unhealthy checkpoint"]), "unhealthy checkpoint"))
    if resumes:
        legend.append((Line2D([], [], **style["resume"]), "resume"))
    if gaps:
        legend.append((Patch(color="#ffbb78", alpha=0.6), "logging gap"))
    if skips:
        legend.append((Line2D([], [], ls="none", marker="|", ms=10, mew=2, color="#d62728"),
                       f"skipped step ({len(skips)})"))
    return legend


def build_parser():
    p = make_parser("python -m dflash.plot", "Plot a dflash run's training curves (from metrics.jsonl) as a PNG.",
                    details="Panels: loss, accuracy per block position, tau (tokens per verify step: simulated, "
                            "and measured held out;\naccepted = tau - 1 on the right), learning rate, gradient "
                            "norm, tokens/s; marked: skipped steps,\ncheckpoints, resumes, logging gaps, loss "
                            "spikes, skipped or cut-short held-out evaluations.",
                    exit_codes=EXIT_CODES,
                    examples=["python -m dflash.plot runs/dflash-tiny",
                              "python -m dflash.plot runs/dflash-tiny -o /tmp/curves.png"])
    p.add_argument("run_dir", help="a dflash run directory (with metrics.jsonl)")
    p.add_argument("-o", "--out", default=None, metavar="FILE.png",
                   help="where to write the PNG (default: RUN_DIR/plot.png)")
    p.add_argument("--dpi", type=int, default=110, help="resolution in dots per inch (the figure is 15 x 8.5 in)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.dpi <= MAX_DPI:  # 15 x 8.5 in at MAX_DPI is already 216M pixels
        parser.error(f"--dpi must be in 1..{MAX_DPI}, got {args.dpi}")
    try:
        out = plot_run(args.run_dir, args.out, dpi=args.dpi)
    except (PlotUnavailable, FileNotFoundError, ValueError) as exc:
        print(f"dflash.plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


__all__ = ["PlotUnavailable", "evaluation_gaps", "main", "make_figure", "plot_run", "tau_limits"]

if __name__ == "__main__":
    sys.exit(main())
