"""Training at long context on one GPU: tokens per second and peak memory of the target forward and
the drafter step at each sequence length, with and without activation checkpointing and a sliding
window in the drafter's layers.

    python -m benchmarks.h200.lengths --out benchmarks/results/lengths_h200.json \\
        [--lengths 2048,8192,16384,32768] [--checkpointing off,on] [--windows 0,2048] \\
        [--warmup 2] [--steps 4] [--budget-s 540] [--set data.source=PATH ...]
    python -m benchmarks.h200.lengths --smoke --out /tmp/lengths.json    # tiny shapes on the CPU

Each length ``L`` trains one packed row of ``L`` tokens per batch (``data.max_length = L``,
``data.tokens_per_batch = L``, ``data.packed_rows = 1``), built by ``data.join = true`` from
consecutive conversations (chat data is short; docs/gpus.md), with ``train.num_anchors = L /
--tokens-per-anchor`` blocks spread over the whole row (the graph's density: 256 blocks per
4,096-token row). The graph is ``examples/qwen3-8b-h200.toml`` (the Qwen3-8B shape, random init);
``--set`` changes it. Per length, the target forward alone
(:func:`benchmarks.h200.stages.time_target`), then the drafter step alone for every
checkpointing x window cell (:func:`~benchmarks.h200.stages.time_drafter`, on features the target
computed for the same batches). A cell that runs out of GPU memory is recorded as such (``"status":
"out of memory"``) and the table goes on; a cell that would end past ``--budget-s`` is skipped.

Results: ``--out`` (JSON, rewritten after every cell) and a table on stdout: length, target tok/s
and peak GiB, and per drafter cell its tok/s, peak GiB and the cost of checkpointing (tok/s with it
over tok/s without, at the same length and window).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GRAPH = ROOT / "examples" / "qwen3-8b-h200.toml"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.h200.lengths", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the results JSON (rewritten after every cell)")
    p.add_argument("--lengths", default=None, help="tokens per sequence (default 2048,8192,16384,32768; smoke 64,128)")
    p.add_argument("--checkpointing", default="off,on", help="drafter activation checkpointing cells: off, on or both")
    p.add_argument("--windows", default="0", help="drafter sliding windows in tokens, 0 = full attention "
                   "(e.g. 0,2048: every drafter layer slides over 2,048 tokens)")
    p.add_argument("--tokens-per-anchor", type=int, default=16, help="train.num_anchors = length / this")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per cell")
    p.add_argument("--steps", type=int, default=4, help="timed steps per cell")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip a cell that would end later than this")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="graph override for every cell, e.g. --set data.source=PATH")
    p.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-lengths")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the plumbing only")
    args = p.parse_args(argv)
    args.lengths = _ints(args.lengths or ("64,128" if args.smoke else "2048,8192,16384,32768"))
    args.checkpointing = [{"off": False, "on": True}[x.strip()] for x in args.checkpointing.split(",") if x.strip()]
    args.windows = _ints(args.windows)
    if not args.lengths or min(args.lengths) < 1 or args.tokens_per_anchor < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--lengths, --tokens-per-anchor and --steps must be >= 1, --warmup >= 0")
    return args


def cell_overrides(length: int, tokens_per_anchor: int, checkpointing: bool, window: int,
                   drafter_layers: int) -> list[str]:
    """The graph overrides of one cell: one joined row of ``length`` tokens per batch, anchors at the
    graph's density, the drafter's checkpointing and window."""
    sets = [f"data.max_length={length}", f"data.tokens_per_batch={length}", "data.packed_rows=1", "data.join=true",
            f"train.num_anchors={max(1, length // tokens_per_anchor)}",
            f"drafter.activation_checkpointing={str(checkpointing).lower()}"]
    if window:
        kinds = ", ".join(['"sliding_attention"'] * drafter_layers)
        sets += [f"drafter.layer_types=[{kinds}]", f"drafter.sliding_window={window}"]
    return sets


class Lengths:
    """One invocation: the target (loaded once), the cells, the results so far."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        import torch

        self.args, self.t0 = args, time.perf_counter()
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible: run on a GPU machine, or use --smoke for the CPU check")
        self.dev = torch.device("cpu" if args.smoke else "cuda:0")
        self.base = list(args.overrides)
        if args.smoke:
            from benchmarks.h200.bench import CPU_SETTINGS, TINY_SETTINGS
            from dflash.data import load_tokenizer, tokenizer_info

            vocab = tokenizer_info(load_tokenizer("builtin:tiny")).vocab_size
            self.base = [*TINY_SETTINGS, f"target.vocab_size={vocab}", *CPU_SETTINGS, "target.compile=false",
                         "drafter.compile=false", *self.base]
        self.doc: dict[str, Any] = {
            "command": "python -m benchmarks.h200.lengths " + " ".join(argv),
            "device": torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu",
            "graph": str(GRAPH.relative_to(ROOT)), "overrides": self.base,
            "settings": {"warmup": args.warmup, "steps": args.steps, "tokens_per_anchor": args.tokens_per_anchor},
            "rows": [],
        }
        self.target = None
        self.peak = float("nan")
        self.step_s = 0.05 if args.smoke else 1.0   # a guess per step until measured

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, out)

    def measure(self, fn: Callable[[], dict[str, Any]], estimate_s: float) -> dict[str, Any]:
        """``fn()``'s result, or why there is none: out of GPU memory, over the budget, or an error."""
        import torch

        from benchmarks.h200.stages import release

        if time.perf_counter() - self.t0 + estimate_s > self.args.budget_s:
            return {"status": "skipped", "reason": f"would end past --budget-s {self.args.budget_s:g}"}
        t = time.perf_counter()
        try:
            out = {"status": "ok", **fn()}
        except torch.OutOfMemoryError as exc:
            out = {"status": "out of memory", "error": str(exc).splitlines()[0][:200]}
        except Exception as exc:  # noqa: BLE001 - one cell's failure is recorded; the table goes on
            out = {"status": "failed", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        finally:
            release()
        out["seconds"] = round(time.perf_counter() - t, 1)
        return out

    def app(self, sets: list[str], name: str) -> Any:
        from benchmarks.h200.stages import scratch_app

        return scratch_app(GRAPH, [*self.base, *sets], self.args.run_root / name)

    def run(self) -> None:
        from benchmarks.h200 import stages
        from benchmarks.h200.stages import make_batches, matmul_tflops, time_target
        from dflash.model.target import load_target
        from dflash.train.loss import needs_final_hidden

        a = self.args
        n = a.warmup + a.steps
        if self.dev.type == "cuda":
            self.peak = matmul_tflops(self.dev)["tflops"]
            self.doc["matmul_tflops"] = round(self.peak, 1)
        for length in a.lengths:
            first = self.app(cell_overrides(length, a.tokens_per_anchor, False, 0, 1), f"L{length}")
            cfg = first.resolved.cfg
            if self.target is None:
                t = time.perf_counter()
                self.target = load_target(cfg.target, self.dev, num_draft_layers=cfg.drafter.num_layers,
                                          need_final=needs_final_hidden(cfg.loss))
                self.doc["target_build_s"] = round(time.perf_counter() - t, 1)
            batches = make_batches(first, n, pin=self.dev.type == "cuda")
            row: dict[str, Any] = {"length": length, "num_anchors": cfg.train.num_anchors,
                                   "tokens_per_step": sum(b.num_tokens for b in batches) / len(batches)}
            row["target"] = self.measure(lambda app=first, b=batches: time_target(app, self.target, b, self.dev, a.warmup,
                                                                                  self.peak), n * self.step_s)
            row["drafter"] = []
            for window in a.windows:
                for ckpt in a.checkpointing:
                    sets = cell_overrides(length, a.tokens_per_anchor, ckpt, window, cfg.drafter.num_layers)
                    app = self.app(sets, f"L{length}-w{window}-c{int(ckpt)}")
                    cell = self.measure(lambda app=app, b=batches: stages.time_drafter(
                        app, self.target, b, self.dev, self.dev, a.warmup, self.peak), 2 * n * self.step_s)
                    app.metrics.close()
                    if cell.get("step_s"):
                        self.step_s = max(self.step_s, cell["step_s"])
                    row["drafter"].append({"checkpointing": ckpt, "window": window, **cell})
                    self.save_row(row)
            first.metrics.close()
            self.save_row(row)

    def save_row(self, row: dict[str, Any]) -> None:
        rows = self.doc["rows"]
        if rows and rows[-1]["length"] == row["length"]:
            rows[-1] = row
        else:
            rows.append(row)
        self.save()


def _cell_text(c: dict[str, Any]) -> str:
    if c.get("status") != "ok":
        return c.get("status", "?")
    peak = next(iter((c.get("peak_mem_gb") or {}).values()), None)    # {} on a CPU
    return f"{c['tok_s'] / 1e3:8.1f}K tok/s" + (f" {peak:6.1f} GiB peak" if peak is not None else "")


def table(doc: dict[str, Any]) -> str:
    """The results as text: per length the target's rate and memory, then each drafter cell's, and
    checkpointing's cost (tok/s with it / without, same length and window)."""
    lines = [f"{doc['device']}: target forward and drafter step alone, one row of L tokens per step"]
    for row in doc["rows"]:
        lines.append(f"L = {row['length']:>6,} ({row['num_anchors']} blocks)  target   {_cell_text(row['target'])}")
        cells = {(c["checkpointing"], c["window"]): c for c in row["drafter"]}
        for (ckpt, window), c in cells.items():
            name = f"drafter{' ckpt' if ckpt else '     '}{f' window {window}' if window else ''}"
            cost = ""
            base = cells.get((False, window))
            if ckpt and c.get("status") == "ok" and base and base.get("status") == "ok":
                cost = f"  ({c['tok_s'] / base['tok_s']:.2f}x of without)"
            lines.append(f"{'':26s}{name:24s} {_cell_text(c)}{cost}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    bench = Lengths(args, argv)
    bench.run()
    bench.save()
    print(table(bench.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
