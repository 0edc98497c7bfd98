"""The H200 quality run of the results log ("Proven drafters"): label strategies at equal steps.

Three label strategies, the same steps and the same held-out prompts, against the shipped target;
then longer runs on regenerated data, and one drafter variant at a time. Phases (one device call each):

  phase1   regenerate --conversations conversations (two turns); meanwhile train "data" (dataset
           labels) and "target_argmax" side by side; eval both -> OUT/regenerated.jsonl.gz
  phase2   on the regenerated data (--regen-gz): the same --steps, and concurrently a --long run; eval;
           decode speed of the long run
  extend   answer conversations up to --conversations (resuming --regen-gz; the eval prompts excluded)
  long     one --long run on that data alone; eval; decode speed
  variant  one drafter --variant at --block-size on --source data; eval; decode speed. DFlash vs
           DFlash2 at equal budgets: two calls (the GPU to itself each), --variant dflash then
           --variant dflash2, same --steps, --train-s, --block-size, data and prompts;
           eval-VARIANT_bsBS.json has tau and, for DFlash2, recall@K / oracle top-K / backbone tau.

Every run: the graph (examples/sharegpt-target-h200.toml: block 16, 3 drafter layers) on the first
--conversations ShareGPT conversations (or the same answered by the target), --steps steps, stopped
gracefully at --train-s. Prompts: benchmarks/quality/prompts.py, the first --num-prompts held-out
records from --prompts-from on (the same prompts in every phase).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.recipe import carry, cli, metrics, report
from benchmarks.recipe.step import Step, python, run, tail

PROG = "python -m benchmarks.quality.labels"
EVAL_KEYS = ("tau", "mean_accepted", "tau_sim", "streak_visited", "streak_all")
SELECTOR_KEYS = ("top_k", "recall", "oracle_tau", "backbone_tau")


def train(args: argparse.Namespace, name: str, *pairs: tuple[str, object]) -> Step:
    """Start run ``name`` (SIGTERM at --train-s: a graceful stop with a final checkpoint)."""
    return Step(python("-m", "dflash.run", args.graph, *cli.sets(
        ("monitor.wandb", "disabled"), ("run.steps", args.steps), ("data.max_samples", args.conversations)),
        "--resume", "none", *cli.sets(extra=args.sets), *cli.sets(("run.out_dir", str(args.scratch / name)), *pairs)),
        args.scratch / f"{name}.log", cap_s=args.train_s)


def evaluate(args: argparse.Namespace, name: str) -> None:
    """dflash.eval of run ``name``'s last checkpoint on the held-out prompts -> OUT/eval-NAME.json.

    Raises:
        SystemExit(1): the eval failed (its error's last lines printed).
    """
    print(tail(args.scratch / f"{name}.log", 3))
    ck, err = metrics.last_checkpoint(args.scratch / name), args.scratch / f"eval-{name}.err"
    path = args.out / f"eval-{name}.json"
    if run(python("-m", "dflash.eval", ck or "", "--prompts", args.scratch / "prompts.jsonl", "--num-prompts",
                  args.num_prompts, "--max-new-tokens", args.new_tokens, "--json"), path, err=err):
        print(tail(err, 5))
        raise SystemExit(1)
    d = report.read_json(path)
    sel = d.get("selector")
    print(name, ck, report.pick(d, EVAL_KEYS), [a if a is None else round(a, 2) for a in d["acc_per_pos"]],
          sel and report.pick(sel, SELECTOR_KEYS))
    src = args.scratch / name / "metrics.jsonl"
    shutil.copyfile(src, args.out / f"metrics-{name}.jsonl")


def decode(args: argparse.Namespace, name: str, tag: str = "") -> None:
    """Target-only greedy vs draft-and-verify with run ``name``'s last checkpoint -> OUT/decode[-TAG].json."""
    log = args.scratch / f"decode{'-' + tag if tag else ''}.log"
    run(python("-m", "benchmarks.decode.speed", metrics.last_checkpoint(args.scratch / name) or "", "--prompts",
               args.scratch / "prompts.jsonl", "--num-prompts", args.num_prompts, "--max-new-tokens", args.new_tokens,
               "--out", args.out / f"decode{'-' + tag if tag else ''}.json"), log)
    print(tail(log, 20))


def regenerated(args: argparse.Namespace, fresh: bool = False) -> Path:
    """R/regenerated.jsonl, unpacked from --regen-gz (always with ``fresh``, else only when missing)."""
    path = args.scratch / "regenerated.jsonl"
    carry.gunzip(args.regen_gz, path, once=not fresh)
    return path


def regenerate(args: argparse.Namespace, *more: object) -> Step:
    """Start dflash.regenerate of the first --conversations conversations (two turns) into R/regenerated.jsonl."""
    return Step(python("-m", "dflash.regenerate", args.graph, "-o", args.scratch / "regenerated.jsonl",
                       *cli.sets(("data.max_samples", args.conversations)), "--max-turns", 2, "--max-new-tokens",
                       args.new_tokens, "--max-prompt-tokens", 768, "--batch-size", 512, "--chunk", 2048, *more),
                args.scratch / "regen.log")


def phase1(args: argparse.Namespace) -> int:
    """Regenerate; meanwhile train "data" and "target_argmax" labels side by side; eval both."""
    regen = regenerate(args)
    a = train(args, "data", ("loss.label", "data"))
    time.sleep(args.wait_s)  # let the first run write the tokenized cache; the second reuses it
    b = train(args, "target_argmax", ("loss.label", "target_argmax"))
    regen.wait()
    print(tail(args.scratch / "regen.log", 2))
    a.wait(), b.wait()
    for name in ("data", "target_argmax"):
        evaluate(args, name)
    carry.gzip_to(args.scratch / "regenerated.jsonl", args.out / "regenerated.jsonl.gz")
    shutil.copyfile(args.scratch / "regen.log", args.out / "regen.log")
    return 0


def phase2(args: argparse.Namespace) -> int:
    """The same steps on regenerated data, and concurrently a long run; eval; decode speed."""
    data = ("data.source", str(regenerated(args, fresh=True)))
    a = train(args, "regenerated", data, ("loss.label", "target_argmax"))
    time.sleep(args.wait_s)
    b = train(args, "regenerated_long", data, ("loss.label", "target_argmax"), ("run.steps", args.long))
    a.wait(), b.wait()
    for name in ("regenerated", "regenerated_long"):
        evaluate(args, name)
    decode(args, "regenerated_long")
    return 0


def extend(args: argparse.Namespace) -> int:
    """Answer conversations up to --conversations, resuming the regenerated file."""
    regenerated(args)
    regenerate(args, "--exclude", args.scratch / "prompts.jsonl").wait()
    print(tail(args.scratch / "regen.log", 2))
    shutil.copyfile(args.scratch / "regen.log", args.out / "regen-extend.log")
    carry.gzip_to(args.scratch / "regenerated.jsonl", args.out / "regenerated.jsonl.gz")
    return 0


def long(args: argparse.Namespace) -> int:
    """One long run on the regenerated data alone; eval; decode speed."""
    data = ("data.source", str(regenerated(args)))
    train(args, "regenerated_long", data, ("loss.label", "target_argmax"), ("run.steps", args.long)).wait()
    evaluate(args, "regenerated_long")
    shutil.copyfile(args.scratch / "regenerated_long.log", args.out / "regenerated_long.log")
    decode(args, "regenerated_long")
    return 0


def variant(args: argparse.Namespace) -> int:
    """One drafter variant at one block size; eval; decode speed."""
    name = f"{args.variant}_bs{args.block_size}"
    data = [("data.source", str(regenerated(args)))] if args.source == "regenerated" else []
    train(args, name, *data, ("loss.label", "target_argmax"), ("drafter.variant", args.variant),
          ("drafter.block_size", args.block_size)).wait()
    evaluate(args, name)
    shutil.copyfile(args.scratch / f"{name}.log", args.out / f"{name}.log")
    decode(args, name, name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The label-strategies recipe's parser: one subcommand per phase."""
    p = cli.recipe_parser(PROG, __doc__, [
        f"{PROG} phase1 OUT", f"{PROG} phase2 OUT",
        f"{PROG} extend OUT --conversations 16000",
        f"{PROG} long OUT --conversations 16000 --long 12000 --train-s 410",
        f"{PROG} variant OUT --variant dflash --block-size 16"])
    shared = cli.phase_arguments("/tmp/quality", "working directory the phases share (runs, cache, regenerated data)")
    shared.add_argument("--steps", type=int, default=3000, help="steps of every run but the long one")
    shared.add_argument("--conversations", type=int, default=8000,
                        help="the first N ShareGPT conversations (data.max_samples; regenerated up to N)")
    shared.add_argument("--train-s", type=float, default=400, help="seconds each run trains before SIGTERM")
    shared.add_argument("--num-prompts", type=int, default=32, help="held-out prompts decoded")
    shared.add_argument("--new-tokens", type=int, default=256, help="tokens per prompt, and per regenerated answer")
    shared.add_argument("--prompts-from", type=int, default=8000, help="the first conversation index prompts come from")
    shared.add_argument("--regen-gz", type=Path, default=Path(".quality/regenerated.jsonl.gz"),
                        help="the regenerated conversations phase 1 or extend wrote")
    cli.add_set(shared, "every run")
    sub = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    for name, fn, wait_s in (("phase1", phase1, 45), ("phase2", phase2, 20)):
        ph = cli.add_phase(sub, name, fn.__doc__, fn, [shared])
        ph.add_argument("--wait-s", type=float, default=wait_s,
                        help="seconds between starting the two runs (the first tokenizes into the shared cache)")
        if name == "phase2":
            ph.add_argument("--long", type=int, default=9000, help="steps of the long run")
    cli.add_phase(sub, "extend", extend.__doc__, extend, [shared])
    ln = cli.add_phase(sub, "long", long.__doc__, long, [shared])
    ln.add_argument("--long", type=int, default=9000, help="steps of the long run")
    v = cli.add_phase(sub, "variant", variant.__doc__, variant, [shared])
    v.add_argument("--variant", default="dflash2", help="drafter.variant of the run")
    v.add_argument("--block-size", type=int, default=16, help="drafter.block_size of the run")
    v.add_argument("--source", choices=("regenerated", "sharegpt"), default="regenerated",
                   help="regenerated: --regen-gz's conversations; sharegpt: the raw ones")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, write the held-out prompts, run the phase, list the results."""
    args = build_parser().parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(DFLASH_CACHE=str(args.scratch / "cache"), PYTHONUNBUFFERED="1")
    carry.held_out_prompts(args.scratch / "prompts.jsonl", args.num_prompts, args.prompts_from, reuse=False)
    rc = args.run(args)
    print(report.listing(args.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
