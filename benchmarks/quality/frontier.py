"""Drafter variants at an equal budget on one H200, against the shipped target, side by side.

Every row trains the same --steps steps (the same cosine schedule), concurrently (each gets about an
equal share of the GPU; --train-s caps the wall time, a row stopped by it reports the steps it
reached), on the same data (the first --conversations ShareGPT conversations, target-argmax labels),
from the same seed; then each final checkpoint is decoded on the same held-out prompts, greedy and at
temperature 1. Each row's training wall time is in OUT/frontier.json (train_s), for the equal-time
comparison.

Time on one H200: six rows of 2,500 steps trained side by side in about 330 s (the slowest row, plus
about 40 s of tokenizing and compiling), their six decodes (16 prompts x 128 tokens, greedy then
T = 1) side by side in about 150 s: more than one 600 s device call with the wheel install, so run
the train and eval phases in two calls on one warm machine (--scratch must survive between them).

Rows (name: what makes it):
  dflash         the default DFlash drafter, CE on the target's argmax (the graph as it is)
  dspark         the same drafter, DSpark's loss: 0.1 CE + 0.9 TV + 1.0 confidence
  dflash2        the DFlash2 variant (grouped dynamic causal convolutions + candidate selector)
  dspark_head    DSpark's recipe as its paper and DeepSpec's trainer write it, in this project's
                 units (their L1 "TV" is twice ours; divided by 1.9): dataset labels, 0.947 TV,
                 0.526 conf with the confidence head, gamma 4
  tv             TV alone (CE weight 0, no confidence term)
  fp8            the dflash row with the target in float8 (torchao, CUDA): trained on fp8-captured
                 features, evaluated against the bf16 target it would serve (--target-quantization none)
  dflash_eqtime  the dflash row with --eq-steps steps (default 1.54 x --steps: DFlash2's measured
                 step cost over DFlash's on the H200), for DFlash vs DFlash2 at equal training time
  dflash_b8, dflash2_b8  the dflash and dflash2 rows at block 8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.recipe import carry, cli, metrics, report
from benchmarks.recipe.step import Step, python, run, tail

PROG = "python -m benchmarks.quality.frontier"
ROWS = {
    "dflash": [],
    "dspark": [("loss.tv_weight", 0.9), ("loss.conf_weight", 1.0)],
    "dflash2": [("drafter.variant", "dflash2")],
    "dspark_head": [("loss.label", "data"), ("loss.tv_weight", 0.947), ("loss.conf_weight", 0.526),
                    ("loss.confidence", "head"), ("loss.gamma", 4)],
    "tv": [("loss.tv_weight", 1.0)],
    "fp8": [("target.quantization", "fp8")],
    "dflash_eqtime": None,  # run.steps = --eq-steps
    "dflash_b8": [("drafter.block_size", 8)],
    "dflash2_b8": [("drafter.variant", "dflash2"), ("drafter.block_size", 8)],
}


def row_sets(args: argparse.Namespace, row: str) -> list[str]:
    """The --set arguments that make ``row``."""
    pairs = ROWS[row] if ROWS[row] is not None else [("run.steps", args.eq_steps)]
    return cli.sets(*pairs)


def common(args: argparse.Namespace) -> list[str]:
    """What every run shares: the graph, the steps, the data, the block size, no periodic checkpoint."""
    return python("-m", "dflash.run", args.graph, *cli.sets(("monitor.wandb", "disabled"), ("run.steps", args.steps),
                                                            ("data.max_samples", args.conversations)),
                  "--resume", "none", *cli.sets(("drafter.block_size", args.block_size), ("checkpoint.every", 0),
                                                extra=args.sets))


def phase_train(args: argparse.Namespace) -> int:
    """Every row trained side by side from one tokenized cache."""
    carry.held_out_prompts(args.scratch / "prompts.jsonl", args.num_prompts, args.conversations, reuse=False)
    # the first run tokenizes the data into the shared cache; the others start once it is there
    warm = args.scratch / "warm.log"
    if run([*common(args), *cli.sets(("run.steps", 1), ("run.out_dir", str(args.scratch / "warm")))], warm):
        print(tail(warm, 5))
    steps = [Step([*common(args), *cli.sets(("run.out_dir", str(args.scratch / row))), *row_sets(args, row)],
                  args.scratch / f"{row}.log", cap_s=args.train_s) for row in args.rows]
    for step in steps:
        step.wait()
    return 0


def phase_eval(args: argparse.Namespace) -> int:
    """Each row's final checkpoint decoded on the held-out prompts (greedy, then T = 1) -> frontier.json."""
    steps = []
    for row in args.rows:
        print(tail(args.scratch / f"{row}.log", 2))
        src = args.scratch / row / "metrics.jsonl"
        if src.is_file():
            (args.out / f"metrics-{row}.jsonl").write_bytes(src.read_bytes())
        ck = metrics.last_checkpoint(args.scratch / row)
        # one decode per row: greedy, then sampled at T = 1 (the JSON's tau and sampled_tau)
        steps.append(Step(python("-m", "dflash.eval", ck or "", "--prompts", args.scratch / "prompts.jsonl",
                                 "--num-prompts", args.num_prompts, "--max-new-tokens", args.new_tokens,
                                 "--temperature", 1, "--seed", 0, "--target-quantization", "none", "--json"),
                          args.out / f"eval-{row}.json", err=args.scratch / f"eval-{row}.err"))
    for step in steps:
        step.wait()
    table = frontier(args.out, args.rows)
    for line in table:
        print(line)
    report.write_json(args.out / "frontier.json", table)
    return 0


def frontier(out: Path, rows: list[str]) -> list[dict]:
    """frontier.json: per row its steps, training seconds, held-out tau greedy and at T = 1."""
    table = []
    for row in rows:
        try:
            recs = metrics.read_records(out / f"metrics-{row}.jsonl")
        except OSError:
            recs = []
        train = metrics.of_kind(recs, "train")
        last = train[-1] if train else {}
        d = report.read_json(out / f"eval-{row}.json")
        table.append({"row": row, "steps": last.get("step"), "train_s": metrics.train_seconds(recs),
                      "tau": d.get("tau"), "accepted": d.get("mean_accepted"),
                      "tau_t1": d.get("sampled_tau"), "accepted_t1": d.get("sampled_accepted"),
                      "tau_sim_train": last.get("tau_sim"), "block_size": d.get("block_size"),
                      **{k: d[k] for k in ("selector", "dtype") if d.get(k) is not None}})
    return table


def phase_all(args: argparse.Namespace) -> int:
    """Train, then eval, in one call."""
    return phase_train(args) or phase_eval(args)


def row_name(text: str) -> str:
    """argparse ``type=`` for a row name (one of ROWS)."""
    if text not in ROWS:
        raise argparse.ArgumentTypeError(f"unknown row {text!r}: one of {', '.join(ROWS)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The frontier recipe's parser: train, eval, or all."""
    p = cli.recipe_parser(PROG, __doc__, [
        f"{PROG} all OUT",
        f"{PROG} all OUT --rows dflash dflash2 dspark_head tv fp8 dflash_eqtime --steps 2500 --train-s 375",
        f"{PROG} train OUT --rows dflash dflash2 --block-size 8   # then: {PROG} eval OUT --rows ..."])
    shared = cli.phase_arguments("/tmp/frontier", "working directory the two phases share (runs, cache, prompts)",
                                 "the graph every row trains")
    shared.add_argument("--rows", nargs="+", type=row_name, default=["dflash", "dflash2", "dspark_head", "tv"],
                        help="the rows, by name (see above)")
    shared.add_argument("--steps", type=int, default=5000, help="steps of every row (the schedule ends there)")
    shared.add_argument("--eq-steps", type=int, help="steps of the dflash_eqtime row (default: 1.54 x --steps)")
    shared.add_argument("--train-s", type=float, default=400, help="seconds each row trains before SIGTERM")
    shared.add_argument("--conversations", type=int, default=8000,
                        help="the first N ShareGPT conversations trained on (data.max_samples); prompts from N on")
    shared.add_argument("--num-prompts", type=int, default=16, help="held-out prompts each row decodes")
    shared.add_argument("--new-tokens", type=int, default=128, help="tokens per held-out prompt")
    shared.add_argument("--block-size", type=int, default=16, help="every row's block size (unless the row sets it)")
    cli.add_set(shared, "every row")
    sub = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    for name, fn in (("train", phase_train), ("eval", phase_eval), ("all", phase_all)):
        cli.add_phase(sub, name, fn.__doc__, fn, [shared])
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, run the phase, list the results."""
    args = build_parser().parse_args(argv)
    if args.eq_steps is None:
        args.eq_steps = args.steps * 154 // 100
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(DFLASH_CACHE=str(args.scratch / "cache"), PYTHONUNBUFFERED="1")
    rc = args.run(args)
    print(report.listing(args.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
