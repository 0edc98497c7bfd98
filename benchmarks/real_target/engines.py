"""Regeneration by the two answer engines side by side (:mod:`dflash.model.answers`): the same
prompts, greedy, each engine for the same wall clock; conversations per second, and how many of the
conversations both answered came out identical.

    python -m benchmarks.real_target.engines GENERATE.jsonl CONTINUOUS.jsonl --seconds S [--json OUT]

Inputs are two ``dflash.regenerate -o`` files (written by ``engines.sh``). Identical means the same
assistant texts; in bf16 on a GPU a tie to rounding may part two engines' answers (the module
docstring of ``dflash.model.answers``), so the figure is a rate, not a pass/fail.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _answers(path: Path) -> dict[int, list[str]]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line of a run stopped at the cap
            continue
        out[row["source_index"]] = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    return out


def compare(generate: Path, continuous: Path, seconds: float) -> dict[str, float | int]:
    """``{engine: conversations, engine_per_s: conversations/s, both, identical, speedup}``."""
    a, b = _answers(generate), _answers(continuous)
    both = a.keys() & b.keys()
    return {"generate": len(a), "continuous": len(b), "generate_per_s": len(a) / seconds,
            "continuous_per_s": len(b) / seconds, "both": len(both),
            "identical": sum(a[i] == b[i] for i in both), "speedup": len(b) / max(len(a), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("generate", type=Path)
    p.add_argument("continuous", type=Path)
    p.add_argument("--seconds", type=float, required=True, help="the wall clock each engine had")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    r = compare(args.generate, args.continuous, args.seconds)
    print(f"generate {r['generate']} conversations ({r['generate_per_s']:.2f}/s), continuous {r['continuous']} "
          f"({r['continuous_per_s']:.2f}/s): {r['speedup']:.2f}x; identical {r['identical']} of {r['both']} answered by both")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
