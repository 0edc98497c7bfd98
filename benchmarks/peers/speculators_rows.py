"""Turn ``DIR/rows.jsonl`` (written by :mod:`benchmarks.peers.cache`, ``--peer speculators``) into the Arrow
dataset ``speculators train --data-path DIR`` reads: columns ``input_ids`` and ``loss_mask``
(int64) and ``seq_len``, in torch format, as speculators' own ``prepare_data`` saves it.

Run with speculators' interpreter (it has ``datasets``; this project does not depend on it):

    $DFLASH_SPECULATORS_PYTHON benchmarks/peers/speculators_rows.py DIR
"""

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from datasets import Dataset

    d = Path(argv[0])
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    with open(d / "rows.jsonl") as f:
        for line in f:
            row = json.loads(line)
            cols["input_ids"].append(row["input_ids"])
            cols["loss_mask"].append(row["loss_mask"])
            cols["seq_len"].append(len(row["input_ids"]))
    ds = Dataset.from_dict(cols)
    ds.set_format(type="torch")
    ds.save_to_disk(str(d))
    print(f"speculators_rows: {len(ds)} rows -> {d}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
