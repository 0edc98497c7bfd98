"""The performance measurements of the target and drafter stages, one suite per device call (one H200).

Each suite runs at most about 9 minutes (--total-s bounds the steps that size themselves to the time
left); results under OUT. First, every suite installs the wheels carried in .whl (torchao,
liger-kernel, msgspec, tomli-w: not in the image) into --pylib and unpacks the ShareGPT subset
.whl/data/sharegpt-subset.jsonl.gz to .devdata/ when present (--data overrides the source); the SM
clock, power and utilisation are sampled every 250 ms into OUT/smi.csv (a rate that drops with the
clock is the power limit, one that drops at full clock is the host or a sync).

  engine   the GPU tests of the engine and kernel switches and the training step's sync test ->
           OUT/gpu-tests.log; then benchmarks/h200/perf.py: bf16 and fp8 matmul peaks, the target alone
           (flex, varlen, varlen compiled; then fp8 in place) with MFU against the matching peak, the
           fp8 feature error per captured layer, the drafter alone (default, Liger kernels, Liger head,
           compiled, all three) with its peak memory, torch.profiler top kernels -> OUT/perf.json,
           OUT/profile_*.txt, OUT/perf.log
  fp8      perf.py's compiled drafter rows in bf16 and float8 (tensorwise with both profiles, then
           rowwise), the fp8 target compiled with its profile (--perf-s bounds this part); then
           bench.py's target alone, drafter alone, serial and pipeline with the fp8 target and the
           float8 drafter -> OUT/perf.json, OUT/h200-fp8-fp8.json
  fastest  the compiled and fp8 target rows with their profiles, then bench.py's serial, colocated
           and pipeline with the fastest target (fp8, varlen, compiled) and with the bf16 one, both
           with the graph's compiled drafter -> OUT/perf.json, OUT/h200-{fp8,bf16}.json; last,
           benchmarks/h200/combine.py puts the three side by side with the goals -> OUT/h200.json
           (the format of benchmarks/results/h200.json, its 2-GPU run kept from --keep-2gpu)
  stages   the sync test, bench.py on one GPU, and the drafter under each of --variants
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.recipe import carry, cli, report
from benchmarks.recipe.step import Clock, Step, python, run, tail

PROG = "python -m benchmarks.h200.suite"
PERF, BENCH = "benchmarks/h200/perf.py", "benchmarks/h200/bench.py"
NOT_SERIAL = "sweep_1gpu,checkpoint_1gpu,target_alone_sdpa,target_alone_flex_attention,target_alone_eager,plain_forward"
ONLY_DRAFTER = ("target_alone,target_alone_sdpa,target_alone_flex_attention,target_alone_eager,plain_forward,serial,"
                "colocated_1gpu,colocated_2gpu,pipeline_1gpu,pipeline_2gpu,checkpoint_1gpu,checkpoint_2gpu,"
                "sweep_1gpu,sweep_2gpu")
FASTEST_ROWS = ("target_bf16,target_bf16_varlen_compile,profile_target_bf16_varlen_compile,fp8_feature_error,"
                "target_fp8_varlen,target_fp8_varlen_compile,profile_target_fp8_varlen_compile,drafter_compile")
FP8_ROWS = ("drafter_compile,profile_drafter_compile,drafter_fp8_compile,profile_drafter_fp8_compile,"
            "drafter_fp8_rowwise_compile,target_fp8_varlen_compile,profile_target_fp8_varlen_compile")
FAST_TARGET = ['target.attn_implementation="varlen"', "target.compile=true"]
VERSIONS = ("import torch, importlib.util as u; print('torch', torch.__version__, torch.cuda.get_device_name(0), "
            "{p: u.find_spec(p) is not None for p in ('torchao', 'liger_kernel', 'msgspec', 'tomli_w', 'triton')})")
clock = Clock()


def left(args: argparse.Namespace) -> int:
    """Seconds of --total-s left."""
    return int(args.total_s) - clock()


def grep(path: Path, pattern: str, limit: int | None = None) -> str:
    """The lines of a log that match ``pattern`` (the first ``limit``)."""
    try:
        lines = [line for line in Path(path).read_text(errors="replace").splitlines() if re.search(pattern, line)]
    except OSError:
        return ""
    return "\n".join(lines[:limit])


def perf(args: argparse.Namespace, cap_s: float, budget_s: float, *more: object) -> None:
    """benchmarks/h200/perf.py on the data -> OUT/perf.json, OUT/perf.log."""
    rc = run(python(PERF, "--out", args.out, "--budget-s", budget_s, *more, "--set", f"data.source={args.data}"),
             args.out / "perf.log", cap_s=cap_s)
    print(f"h200_perf rc={rc} in {clock()} s")


def bench(args: argparse.Namespace, name: str, sets: list[str], skip: str, rows: str) -> None:
    """bench.py in the time left (skipped under 60 s) -> OUT/h200-NAME.json; its rate lines printed."""
    b = left(args) - 15
    if b < 60:
        print(f"bench {name.replace('-', '+')}: skipped, {b}s left")
        return
    rc = run(python(BENCH, "--budget-s", b, "--warmup", args.warmup, "--steps", 10, "--set",
                    f"data.source={args.data}", *cli.sets(extra=sets), "--skip", skip, "--out",
                    args.out / f"h200-{name}.json"), args.out / f"bench-{name}.log", cap_s=b + 10)
    print(f"bench {name.replace('-', '+')} rc={rc}")
    print(grep(args.out / f"bench-{name}.log", rf"^({rows})_tok_s"))


def suite_fastest(args: argparse.Namespace) -> int:
    """The compiled bf16 and fp8 targets and the loop around each, combined with the goals."""
    perf(args, 260, 240, "--warmup", 3, "--steps", 8, "--rows", args.rows or FASTEST_ROWS)
    print(tail(args.out / "perf.log", 12))
    for v in ("fp8", "bf16"):
        sets = FAST_TARGET + (['target.quantization="fp8"'] if v == "fp8" else [])
        bench(args, v, sets, NOT_SERIAL, "serial|pipeline_1gpu|colocated_1gpu|target_alone|drafter_alone")
    keep = ["--keep-2gpu", args.keep_2gpu] if args.keep_2gpu else []
    rc = run(python("-m", "benchmarks.h200.combine", args.out, *keep), args.out / "combine.log")
    print(f"combine rc={rc} -> {args.out}/h200.json")
    print("\n".join((args.out / "combine.log").read_text(errors="replace").splitlines()[:9]))
    return 0


def suite_fp8(args: argparse.Namespace) -> int:
    """The drafter's float8 training against its bf16 compiled step, the fp8 target, then both in the loop."""
    perf(args, args.perf_s, args.perf_s - 20, "--warmup", args.perf_warmup, "--steps", args.perf_steps,
         "--rows", args.rows or FP8_ROWS)
    print(tail(args.out / "perf.log", 14))
    sets = FAST_TARGET + ['target.quantization="fp8"', 'drafter.precision="fp8"']
    sets += [f'drafter.fp8_recipe="{args.fp8_recipe}"'] if args.fp8_recipe else []
    bench(args, "fp8-fp8", sets, NOT_SERIAL + ",colocated_1gpu", "serial|pipeline_1gpu|target_alone|drafter_alone")
    return 0


def suite_engine(args: argparse.Namespace) -> int:
    """The engine and kernel switches: their GPU tests, then perf.py's rows."""
    if args.tests:
        rc = run(python("-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
                        "tests/dflash/train/test_perf_switches.py", "tests/dflash/train/test_step_sync.py"),
                 args.out / "gpu-tests.log", cap_s=200)
        print(f"gpu tests rc={rc} ({tail(args.out / 'gpu-tests.log', 1)})")
    b = left(args) - 25
    perf(args, b + 20, b, "--warmup", args.perf_warmup, "--steps", args.perf_steps,
         *(["--rows", args.rows] if args.rows else []))
    print(tail(args.out / "perf.log", 25))
    return 0


def suite_stages(args: argparse.Namespace) -> int:
    """The sync test, bench.py on one GPU, and the drafter under each variant switch."""
    v = args.out / "v"
    v.mkdir(exist_ok=True)
    rc = run(python("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                    "tests/dflash/train/test_step_sync.py"), v / "gpu-sync.log", cap_s=90)
    print(f"sync test rc={rc} ({tail(v / 'gpu-sync.log', 1)})")
    rc = run(python(BENCH, "--budget-s", args.budget_s, "--set", f"data.source={args.data}", "--skip",
                    "sweep_1gpu,checkpoint_1gpu,target_alone_eager", "--out", args.out / "h200-x1.json",
                    "--artifacts", args.out / "x1"), args.out / "bench.log", cap_s=args.main_s)
    print(f"main bench rc={rc}")
    print(tail(args.out / "bench.log", 30))
    for i, setting in enumerate(args.variants, 1):
        n = left(args)
        if n < 60:
            print(f"variant {setting}: skipped, {n}s left")
            continue
        rc = run(python(BENCH, "--budget-s", n - 20, "--skip", ONLY_DRAFTER, "--set", f"data.source={args.data}",
                        "--set", setting, "--out", v / f"variant-{i}.json"), v / f"variant-{i}.log", cap_s=n - 5)
        print(f"variant {i} {setting} rc={rc}")
        print(grep(v / f"variant-{i}.log", r"drafter_alone|drafter_stage_mfu", 3))
    with tarfile.open(args.out / "variants.tgz", "w:gz") as tar:
        tar.add(v, arcname="v")
    shutil.rmtree(v)
    return 0


def prepare(args: argparse.Namespace) -> Step | None:
    """Wheels, data and the versions line; the nvidia-smi sampler (None without nvidia-smi)."""
    rc = carry.install_wheels(carry.WHEELS, args.pylib, args.out / "pip.log")
    if rc is not None:
        carry.on_path(args.pylib)
        print(f"wheels rc={rc} -> {args.pylib}: {' '.join(p.name for p in sorted(carry.WHEELS.glob('*.whl')))}")
    subset = Path(".devdata/sharegpt-subset.jsonl")
    carry.gunzip(carry.WHEELS / "data" / "sharegpt-subset.jsonl.gz", subset)
    args.data = args.data or (str(subset) if subset.is_file() else "sharegpt")
    versions = subprocess.run(python("-c", VERSIONS), capture_output=True, text=True)
    print(versions.stdout.strip() or versions.stderr.strip().splitlines()[-1:])
    if shutil.which("nvidia-smi") is None:
        return None
    return Step(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu",
                 "--format=csv", "-lms", "250"], args.out / "smi.csv", err=Path(os.devnull))


def build_parser() -> argparse.ArgumentParser:
    """The suite recipe's parser: one subcommand per suite."""
    p = cli.recipe_parser(PROG, __doc__, [f"{PROG} engine OUT", f"{PROG} fastest OUT --total-s 430",
                                          f"{PROG} fp8 OUT --total-s 445 --perf-s 250"])
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("out", type=Path, help="where the results go (OUT)")
    s.add_argument("--data", help="[data].source of every run (default: the carried subset, else sharegpt)")
    s.add_argument("--pylib", type=Path, default=Path("/tmp/dflash-pylib"), help="where the carried wheels go")
    s.add_argument("--total-s", type=int, default=530,
                   help="the suite's seconds; the last steps size themselves to what is left")
    s.add_argument("--warmup", type=int, default=10, help="untimed steps of each bench.py measurement "
                   "(a compiled target in a pipeline thread needed about 8 to reach its rate)")
    s.add_argument("--perf-warmup", type=int, default=3, help="untimed steps of each perf.py row")
    s.add_argument("--perf-steps", type=int, default=8, help="timed steps of each perf.py row")
    s.add_argument("--rows", help="perf.py's rows, comma-separated (default: the suite's)")
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    e = cli.add_phase(sub, "engine", suite_engine.__doc__, suite_engine, [s])
    e.add_argument("--no-tests", dest="tests", action="store_false", help="skip the GPU tests")
    f = cli.add_phase(sub, "fp8", suite_fp8.__doc__, suite_fp8, [s])
    f.add_argument("--perf-s", type=int, default=330, help="seconds of the perf.py part")
    f.add_argument("--fp8-recipe", help="[drafter].fp8_recipe of the bench run (default: the graph's)")
    fa = cli.add_phase(sub, "fastest", suite_fastest.__doc__, suite_fastest, [s])
    fa.add_argument("--keep-2gpu", default="benchmarks/results/h200.json",
                    help="the results file whose 2-GPU run h200.json keeps; '' keeps none")
    st = cli.add_phase(sub, "stages", suite_stages.__doc__, suite_stages, [s])
    st.add_argument("--main-s", type=float, default=360, help="cap of the one-GPU bench.py run, in seconds")
    st.add_argument("--budget-s", type=int, default=320, help="bench.py's own budget, in seconds")
    st.add_argument("--variants", nargs="*", default=["train.sync_free_loss=false",
                                                       'drafter.attn_implementation="flex_attention"',
                                                       "train.lm_head_chunk=2048"],
                    help="one --set each, the drafter measured under it")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, prepare the machine, run the suite, list its files."""
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    smi = prepare(args)
    try:
        rc = args.run(args)
    finally:
        if smi is not None:
            smi.proc.terminate()
            smi.wait()
    print(report.listing(args.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
