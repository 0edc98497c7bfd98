"""What the recipes read back from a ``dflash.run`` run: its ``metrics.jsonl`` records and the
figures made of them, and its newest checkpoint.

``metrics.jsonl`` holds one JSON object per line, each with a ``kind``: ``start`` (the run's data
and batching, ``time``), ``train`` (one window of ``window`` steps: ``step``, ``tok_s``, ``tau_sim``,
``time``), ``heldout`` (an evaluation of the drafter's weights: ``step``, ``tau``, ``sampled_tau``,
``seconds``, ``prompts``), ``checkpoint`` and others the recipes do not read.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

WARMUP_WINDOWS = 2  # the train windows a rate leaves out: compiling, tokenizer and allocator warm-up


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl``, in file order.

    Raises:
        OSError: the file cannot be read (the run wrote none).
    """
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The records of one ``kind`` (``"train"``, ``"heldout"`` ...), in file order."""
    return [r for r in records if r.get("kind") == kind]


def steady_tok_s(records: list[dict[str, Any]], warmup: int = WARMUP_WINDOWS) -> float | None:
    """Training tokens per second once warm: the median ``tok_s`` of the train windows after the
    first ``warmup`` (compiling and warm-up make those slow); None when no window is left."""
    rates = [w["tok_s"] for w in of_kind(records, "train")[warmup:] if w.get("tok_s")]
    return statistics.median(rates) if rates else None


def last_step(records: list[dict[str, Any]]) -> int | None:
    """The step of the last train window; None when the run logged none."""
    train = of_kind(records, "train")
    return train[-1]["step"] if train else None


def train_seconds(records: list[dict[str, Any]]) -> float | None:
    """Seconds from the run's start record to its last train window (tokenizing a cache miss and
    compiling included), to 0.1 s; None when either is missing."""
    train = of_kind(records, "train")
    t0 = next((r["time"] for r in records if r.get("kind") == "start" and "time" in r), None)
    if t0 is None or not train or "time" not in train[-1]:
        return None
    return round(train[-1]["time"] - t0, 1)


def last_checkpoint(run_dir: Path) -> Path | None:
    """The newest ``checkpoints/step_*`` directory of a run directory; None when it has none."""
    found = sorted(p for p in Path(run_dir).glob("checkpoints/step_*") if p.is_dir())
    return found[-1] if found else None
