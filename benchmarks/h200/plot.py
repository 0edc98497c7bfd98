"""Plot benchmarks/results/h200.json (from h200/bench.py) to benchmarks/results/h200.png.

    python benchmarks/h200/plot.py [--in benchmarks/results/h200.json] [--out benchmarks/results/h200.png]
                                   [--results-md benchmarks/results/LOG.md]

Three panels: (1) tokens/s of the serial loop and the pipelines, with each stage alone as the bound;
(2) pipeline tokens/s against the capacity of the target -> drafter channels; (3) step times of the
checkpoint run, the steps that overlap a background save marked. Needs matplotlib (a dependency of this package).
``--results-md`` also rewrites the generated results section of that markdown file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
IN = HERE / "results" / "h200.json"
OUT = HERE / "results" / "h200.png"


def _ok(doc: dict[str, Any], run: str | None, name: str) -> dict[str, Any] | None:
    m = doc.get("runs", {}).get(run or "", {}).get("measurements", {}).get(name)
    return m if m and m.get("status") == "ok" else None


def _throughput(ax: Any, doc: dict[str, Any]) -> None:
    bars = [("serial\n(1 GPU)", doc.get("serial_tok_s")),
            ("pipeline\n1 GPU", doc.get("pipeline_1gpu_tok_s")),
            ("pipeline\n2 GPUs", doc.get("pipeline_2gpu_tok_s"))]
    xs = range(len(bars))
    ax.bar(xs, [v or 0 for _, v in bars], color=["#888888", "#4c72b0", "#55a868"])
    for x, (_, v) in zip(xs, bars):
        ax.text(x, (v or 0), "n/a" if v is None else f"{v / 1e3:.1f}K", ha="center", va="bottom", fontsize=8)
    for key, style, label in (("target_alone_tok_s", "--", "target alone"),
                              ("drafter_alone_tok_s", ":", "drafter alone")):
        if doc.get(key):
            ax.axhline(doc[key], ls=style, color="k", lw=1, label=f"{label} {doc[key] / 1e3:.1f}K")
    ax.set_xticks(list(xs), [b for b, _ in bars], fontsize=8)
    ax.set_ylabel("tokens/s (real tokens)")
    eff, spd = doc.get("efficiency_2gpu"), doc.get("speedup_2gpu_vs_serial")
    title = "throughput"
    if eff is not None and spd is not None:
        title += f"\n2 GPUs: efficiency {eff:.2f}, speedup {spd:.2f}x"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def _sweep(ax: Any, doc: dict[str, Any]) -> None:
    sweep = doc.get("capacity_sweep") or {}
    for mode, marker in (("1gpu", "o"), ("2gpu", "s")):
        pts = {int(c): v for c, v in (sweep.get(mode) or {}).get("tok_s", {}).items() if v is not None}
        if pts:
            caps = sorted(pts)
            ax.plot(caps, [pts[c] for c in caps], marker=marker, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel("capacity of hidden and features (items)")
    ax.set_ylabel("tokens/s")
    ax.set_title("channel capacity", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _checkpoint(ax: Any, doc: dict[str, Any]) -> None:
    src = (doc.get("sources") or {}).get("checkpoint_slowdown")
    mode = "2gpu" if _ok(doc, src, "checkpoint_2gpu") else "1gpu"
    m = _ok(doc, src, f"checkpoint_{mode}")
    if not m:
        ax.text(0.5, 0.5, "no checkpoint run", ha="center", transform=ax.transAxes)
        return
    p = m["pipeline"]
    steps, ends = p["steps"], p["step_end_s"]
    during = {s for save in m["saves"] for s in save["steps_overlapped"]}
    xs = [s for s in steps[1:]]
    ys = [1e3 * (ends[i] - ends[i - 1]) for i in range(1, len(steps))]
    colors = ["#c44e52" if s in during else ("#bbbbbb" if s <= p["warmup"] else "#4c72b0") for s in xs]
    ax.bar(xs, ys, color=colors)
    for save in m["saves"]:
        ax.axvline(save["step"] + 0.5, color="#c44e52", lw=0.8, ls="--")
    slow = m.get("slowdown")
    ax.set_title(f"checkpoint run ({mode}): red = overlaps a save\n"
                 f"slowdown {'n/a' if slow is None else f'{100 * slow:+.1f}%'}", fontsize=9)
    ax.set_xlabel("drafter step (grey = warmup)")
    ax.set_ylabel("step time (ms)")


def plot(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    _throughput(axes[0], doc)
    _sweep(axes[1], doc)
    _checkpoint(axes[2], doc)
    gpus = sorted({g for r in doc.get("runs", {}).values() for g in r.get("env", {}).get("gpus", [])})
    mfu, plain = doc.get("target_mfu"), doc.get("plain_forward_mfu")
    sub = f"target MFU {mfu:.2f} vs plain transformers {plain:.2f}" if mfu is not None and plain is not None else ""
    smoke = " -- CPU SMOKE RUN, NOT H200 NUMBERS" if doc.get("smoke") else ""
    fig.suptitle(f"DFlash training, Qwen3-8B-shaped target ({', '.join(gpus) or 'cpu'}){smoke}\n{sub}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in", dest="src", type=Path, default=IN)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--results-md", type=Path, default=None,
                   help="also fill the results section of this file (e.g. benchmarks/results/LOG.md)")
    args = p.parse_args(argv)
    doc = json.loads(args.src.read_text())
    plot(doc, args.out)
    print(f"wrote {args.out}")
    if args.results_md is not None:
        sys.path.insert(0, str(HERE.parent))
        from benchmarks.h200.report import update_markdown

        update_markdown(args.results_md, doc)
        print(f"updated {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
