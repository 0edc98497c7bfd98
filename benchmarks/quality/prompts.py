"""Write the quality run's eval prompts: ShareGPT conversations no model here ever trained on.

A record qualifies when the shipped target held it out of pretraining (its ``heldout.json``) and
its index is at or past ``--first-unused`` (the drafter runs train on, and regenerate, only the
records before it). Each prompt is the conversation's first user turn; conversations that open
with an assistant turn are skipped. Output: ``{"prompt": str, "source_index": int}`` lines for
``python -m dflash.eval CKPT --prompts FILE``.

    python -m benchmarks.quality.prompts -o prompts.jsonl --first-unused 8000 --num 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.prompts", description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--target", default="dflash/assets/target-sharegpt-7m")
    p.add_argument("--first-unused", type=int, default=8000)
    p.add_argument("--num", type=int, default=32)
    args = p.parse_args(argv)
    from dflash.data.sources import read_source

    held = set(json.loads((Path(args.target) / "heldout.json").read_text())["record_indices"])
    records = read_source("sharegpt")
    out = []
    for conv, i in zip(records.conversations, records.source_index):
        if i >= args.first_unused and i in held and conv[0]["role"] == "user":
            out.append({"prompt": conv[0]["content"], "source_index": i})
        if len(out) == args.num:
            break
    Path(args.out).write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in out))
    print(f"{len(out)} prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
