"""The target as an inference engine and the drafter on fused kernels, measured on one H200.

    python benchmarks/h200/perf.py --out OUT [--set data.source=PATH] [--budget-s 420] [--rows a,b,..]
    python benchmarks/h200/perf.py --smoke --out OUT     # tiny shapes on the CPU: the plumbing only
    python benchmarks/h200/perf.py --graph examples/smollm2-h200.toml --set target.path=\"DIR\" --out OUT --rows drafter_compile

Rows (run in the priority order of :meth:`Perf.plan`; each skipped when it would end past ``--budget-s``, each saved as it ends):

* ``matmul_bf16`` / ``matmul_fp8``: ``8192^3`` bf16 ``torch.mm`` and float8 e4m3
  ``torch._scaled_mm`` (per-row scales, bf16 out, fast accumulation: the kernel torchao's fp8 path
  calls), the MFU denominators;
* ``target_<variant>``: the target forward alone (:func:`benchmarks.h200.stages.time_target`) for
  the graph's attention (flex) and ``varlen`` (``target_bf16_varlen_compile`` only when named in
  ``--rows``), then, after quantizing the same model in place, ``fp8`` with flex, varlen and varlen
  compiled; MFU against the matching peak (``mfu``) and against bf16 (``mfu_vs_bf16``);
* ``fp8_feature_error``: per captured layer, ``||f_fp8 - f_bf16|| / ||f_bf16||`` and the cosine
  over the real tokens of two batches;
* ``drafter_<variant>``: the drafter step alone (:func:`benchmarks.h200.stages.time_drafter`) with
  the default settings, ``drafter.kernels = "liger"``, ``train.lm_head = "liger"``,
  ``drafter.compile = true`` and all three, then ``drafter.precision = "fp8"`` eager, compiled,
  and compiled with the rowwise recipe (MFU against the bf16 peak: attention, norms and the LM head
  stay bf16); ``peak_mem_gb`` is the drafter stage's peak at the graph's 151,936-token vocabulary;
* ``profile_target_*`` / ``profile_drafter_*``: ``torch.profiler`` over three steps, the top
  kernels by device time (``OUT/profile_*.txt`` and in the JSON); the compiled targets'
  (``profile_target_{bf16,fp8}_varlen_compile``, named in ``--rows`` with their timing row) are
  taken inside that row, as it ran, and recorded in it.

Results: ``OUT/perf.json`` (rewritten after every row), the profiles beside it.

The rows and their plan are ``benchmarks/h200/perf_rows.py``'s (:class:`Perf`), the profiler window
``benchmarks/h200/profiling.py``'s; this module is the command line, and their names are importable
from here too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.h200.graphs import CPU_SETTINGS, GRAPH_1GPU, TINY_SETTINGS  # noqa: E402,F401
from benchmarks.h200.perf_rows import (  # noqa: E402,F401 - importable from here too
    DRAFTER_ROWS,
    FIXED_S,
    PROFILE_ROWS,
    TARGET_ROWS,
    Perf,
    summary,
)
from benchmarks.h200.profiling import profile, top_kernels  # noqa: E402,F401
from benchmarks.h200.stages import scaled_mm_tflops  # noqa: E402,F401 - the fp8 peak, shared with bench_h200


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/h200/perf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for perf.json and the profiles")
    p.add_argument("--graph", type=Path, default=GRAPH_1GPU,
                   help="the graph whose stages are measured (default examples/qwen3-8b-h200.toml; e.g. "
                        "examples/smollm2-h200.toml with --set target.path=DIR for a real target)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip a row that would end later than this")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", default="", help="comma-separated rows to run (default all): "
                   + ", ".join(["matmul_bf16", "matmul_fp8", *TARGET_ROWS, *DRAFTER_ROWS, *PROFILE_ROWS,
                                "profile_target_bf16_varlen_compile", "profile_target_fp8_varlen_compile"]))
    p.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-perf")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing only)")
    args = p.parse_args(argv)
    args.rows = {r for r in args.rows.split(",") if r}
    if args.rows:  # the matmul rows are the MFU denominators: always measured
        args.rows |= {"matmul_bf16", "matmul_fp8"}
    Perf(args).execute()
    return 0


if __name__ == "__main__":
    sys.exit(main())
