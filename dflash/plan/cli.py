"""The ``python -m dflash.plan`` command line: read the run, rank the layouts, write the best graph."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from csp.cli import make_parser, positive_float, positive_int
from csp.observe.units import count
from dflash.plan.model import Layout, colocated, layouts

if TYPE_CHECKING:
    from dflash.plan.measure import Measured

SHOW = 8  # layouts printed

MAX_GPUS = 2 ** 17
"""The largest ``--gpus`` planned for (131,072): above the largest GPU clusters built (about 100K
GPUs). The search evaluates every k:m split, so its time and memory grow with ``--gpus`` (a third
of a second here, on one CPU core; ``--gpus 10**9`` would run for most of an hour)."""


def _parser():
    p = make_parser(
        "python -m dflash.plan", "Rank the layouts of a DFlash run on N GPUs by predicted tokens/s, from a "
        "finished run's measurements, and write the best one as a graph file.",
        details="The model and its terms: the dflash.plan module docstring (python -c 'import dflash.plan; "
                "help(dflash.plan)'). Run it from the directory the measured run started in: the written "
                "graph's relative paths are made absolute against it.",
        exit_codes={0: "ranked (and written with -o)",
                    2: "a bad run directory or number, an -o file it must not replace, or rates measured "
                       "on a CPU without --extrapolate"},
        examples=["python -m dflash.plan runs/qwen3-8b-h200 --gpus 8",
                  "python -m dflash.plan runs/dflash-tiny --gpus 8 --extrapolate   # CPU rates: a guess, marked ~",
                  "python -m dflash.plan runs/qwen3-8b-h200x2 --gpus 16 --hosts 2 --net-gbps 400 -o plan16.toml"])
    p.add_argument("run", help="a finished dflash.run directory (config.toml, csp/stats.jsonl, metrics.jsonl)")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs to plan for, over all hosts")
    p.add_argument("--hosts", type=positive_int, default=1, help="hosts the GPUs are spread over (evenly)")
    p.add_argument("--gpu-mem", type=positive_float, help="GiB per GPU: layouts that need more are left out")
    p.add_argument("--net-gbps", type=positive_float, default=400.0,
                   help="network between hosts, Gbit/s per GPU and direction")
    p.add_argument("--target-tok-s", type=positive_float, help="one target replica alone, tokens/s (replaces the run's)")
    p.add_argument("--drafter-tok-s", type=positive_float,
                   help="one drafter replica alone, tokens/s (replaces the run's)")
    p.add_argument("--coloc", type=positive_float,
                   help="colocation efficiency in (0, 1] (replaces the measured or default one)")
    p.add_argument("--window", type=positive_float, help="only the last seconds of the stats log")
    p.add_argument("-o", "--out", help="write the best layout's graph file here (a file there is replaced only "
                                        "if dflash.plan wrote it, or with --force; never the run's config.toml)")
    p.add_argument("--force", action="store_true", help="replace an -o file that dflash.plan did not write")
    p.add_argument("--extrapolate", action="store_true",
                   help="lay out GPUs from stage rates measured on a CPU (refused otherwise); every predicted "
                        "figure is then marked ~ as extrapolated")
    return p


PLAN_MARK = "# dflash.plan "
"""How a graph file written by ``-o`` begins (its header's first line): the files ``-o`` may replace."""


def _out_refusal(out: str | None, run: str, force: bool) -> str | None:
    """Why ``-o out`` must not be written, in one line, or None: it is empty, the run's own
    ``config.toml`` (never, whatever ``--force`` says; a symlink or a hard link to it is the same
    file), a directory, or a file that is not a plan this command wrote (unless ``force``)."""
    if out is None:
        return None
    if not out.strip():
        return f"-o {out!r} is not a file path; give one, e.g. -o plan.toml"
    path = Path(out)
    try:
        own = Path(run) / "config.toml"
        if path.resolve() == own.resolve() or (path.exists() and own.exists() and os.path.samefile(path, own)):
            return (f"-o {out} is the run's own config.toml, the record of what it trained with; write the "
                    "plan elsewhere, e.g. -o plan.toml")
        if path.is_dir():
            return f"-o {out} is a directory; give a file path, e.g. -o {Path(out) / 'plan.toml'}"
        if path.exists() and not force:
            with path.open("rb") as f:
                first = f.readline(4096).decode("utf-8", "replace")
            if not first.startswith(PLAN_MARK):
                return (f"-o {out} exists and is not a plan dflash.plan wrote; give a new path, or --force "
                        "to replace it")
    except OSError as e:
        return f"-o {out}: cannot be checked ({e.strerror or e}); give another path"
    return None


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new file renamed over it: a hard link to the old file
    (another copy of a config) keeps its contents, and a failed write leaves the old file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def render(m: Measured, ranked: list[Layout], base: Layout, show: int = SHOW) -> str:
    """The plan as plain text: the inputs, the model's check on the run, the ranked layouts. Rates
    measured on a CPU and laid out on GPUs (``--extrapolate``) mark every predicted figure ``~``."""
    i = m.inputs
    guess = "~" if m.measured_on == "cpu" else ""
    lines = [(f"inputs: target {count(i.target_tok_s)} tok/s, drafter {count(i.drafter_tok_s)} tok/s per "
              f"replica; coloc {i.coloc:.2f} ({i.coloc_source})"),
             (f"        hidden {i.bytes_per_token:,.0f} B/token; all-reduce {i.grad_bytes / 1e9:.3g} GB/step; "
              f"memory: target {i.target_mem / 2**30:.1f} GiB, drafter {i.drafter_mem / 2**30:.1f} GiB"),
             (f"check: this run's layout predicted {count(m.predicted_tok_s)} tok/s (bound {m.bottleneck}), "
              f"measured {count(m.measured_tok_s)} over {m.measured_over} "
              f"({m.predicted_tok_s / m.measured_tok_s:.2f}x)"),
             *(f"note: {n}" for n in m.notes), ""]
    head = ["layout", "tok/s", "vs colocated", "bound", "GiB/GPU", "cross-host GB/s"]
    if guess:
        lines.insert(0, "EXTRAPOLATED: the stage rates were measured on a CPU; every ~ figure below lays them "
                        "out on GPUs as if they were GPU rates, which they are not")
    rows = [[lay.name, guess + count(lay.tok_s), f"{lay.tok_s / base.tok_s:.2f}x", lay.bound, f"{lay.mem_gib:.1f}",
             f"{lay.cross_host_gb_s:.1f}" if lay.hosts > 1 else "-"] for lay in ranked[:show]]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(x.ljust(w) if c in (0, 3) else x.rjust(w) for c, (x, w) in enumerate(zip(r, widths))))
    return "\n".join(lines) + "\n"


def _refusal(args) -> str | None:
    """What is wrong with numbers no layout can be planned for, in one line, or None (argparse
    has already refused counts below 1 and rates <= 0)."""
    if args.gpus > MAX_GPUS:
        return (f"--gpus {args.gpus} is more than {MAX_GPUS:,} GPUs, above any cluster built; "
                f"plan for at most {MAX_GPUS}")
    if args.hosts > args.gpus:
        return (f"--hosts {args.hosts} is more than --gpus {args.gpus}: every host holds at least one GPU; "
                "give --hosts <= --gpus")
    if args.gpus % args.hosts:
        return f"--gpus {args.gpus} is not a multiple of --hosts {args.hosts}: every host holds the same GPUs"
    # coloc: tok/s of one GPU running both stages over their serial bound 1 / (1/T + 1/D). The
    # model treats sharing as a cost (0.99 measured on one H200); above 1 it would predict a shared
    # GPU beating both stages run back to back, and rank the shared layouts on that
    if args.coloc is not None and not args.coloc <= 1.0:
        return (f"--coloc must be in (0, 1] (one GPU running both stages, over their serial bound; "
                f"0.99 measured on one H200), got {args.coloc:g}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    refusal = _refusal(args) or _out_refusal(args.out, args.run, args.force)
    if refusal is not None:
        print(f"dflash.plan: error: {refusal}", file=sys.stderr)
        return 2
    # csp and torch load after --help has answered
    from dflash.plan.measure import PlanError, from_run
    from dflash.plan.write import command, graph_toml

    try:
        m = from_run(args.run, target_tok_s=args.target_tok_s, drafter_tok_s=args.drafter_tok_s,
                     coloc=args.coloc, window_s=args.window, net_bytes_per_s=args.net_gbps * 1e9 / 8)
        ranked = layouts(m.inputs, args.gpus, args.hosts, args.gpu_mem)
        if not ranked:
            raise PlanError(f"no layout fits --gpu-mem {args.gpu_mem:g} GiB; the smallest needs "
                            f"{min(x.mem_gib for x in layouts(m.inputs, args.gpus, args.hosts)):.1f}")
    except PlanError as exc:
        print(f"dflash.plan: error: {exc}", file=sys.stderr)
        return 2
    if m.measured_on == "cpu" and not args.extrapolate:
        print(f"dflash.plan: error: {args.run}'s stage rates were measured on a CPU; a layout of GPUs from them "
              "would be a guess: give --target-tok-s and --drafter-tok-s measured on your GPUs, or "
              "--extrapolate to lay it out anyway (every predicted figure then marked ~)", file=sys.stderr)
        return 2
    base = colocated(m.inputs, args.gpus, args.hosts)
    sys.stdout.write(render(m, ranked, base))
    best = ranked[0]
    if args.out:
        slug = best.name.replace(" ", "-").replace(":", "to").replace("+", "")
        header = (f"{PLAN_MARK[2:]}{args.run} --gpus {args.gpus} --hosts {args.hosts}: {best.name}, "
                  f"{'EXTRAPOLATED from CPU rates, ' if m.measured_on == 'cpu' else ''}predicted "
                  f"{count(best.tok_s)} tok/s (bound {best.bound}; {best.tok_s / base.tok_s:.2f}x colocated)\n"
                  f"{command(best, args.out)}\ninputs: {msgspec.json.encode(m.inputs).decode()}")
        try:
            _replace(Path(args.out), graph_toml(m.config, best, slug, header))
        except OSError as e:
            print(f"dflash.plan: cannot write -o {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"\nwrote {args.out}: {best.name}\n  {command(best, args.out)}")
    else:
        print(f"\nbest: {best.name}\n  {command(best, 'GRAPH.toml')}   # -o GRAPH.toml writes it")
    return 0


__all__ = ["MAX_GPUS", "PLAN_MARK", "main", "render"]
