"""The health of a run's checkpoints, as ``python -m dflash.logs`` reports it.

Every ``checkpoints/step_*`` (and leftover ``.tmp-*``) directory with its ``meta.json`` health, and
which one ``resume = "auto"`` would pick: the newest complete healthy one whose files and tensors
pass :func:`dflash.checkpoint.resume.verify`; the newer ones are listed with why they were passed
over. ``checkpoints/archive-*`` directories (an earlier lineage moved aside) are counted only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from dflash.checkpoint.format import ARCHIVE_PREFIX, META, PREFIX, TMP_PREFIX

__all__ = ["CheckpointInfo", "scan_archives", "scan_checkpoints"]


class CheckpointInfo(msgspec.Struct, frozen=True):
    """One checkpoint directory: ``complete`` (has meta.json), its step, loss, health, save time,
    whether resume = "auto" would pick it, and why not."""

    name: str
    complete: bool
    step: int | None = None
    loss: float | None = None
    healthy: bool | None = None
    save_s: float | None = None
    auto_resume: bool = False
    problem: str | None = None  # why resume = "auto" would not use it (None: usable, or not checked)


def scan_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every ``step_*`` and ``.tmp-*`` directory under ``run_dir/checkpoints``, sorted by name, with
    its health and, by resume = "auto"'s rule, which one it would pick (module docstring)."""
    from dflash.checkpoint import CheckpointError, check_files, verify

    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith((PREFIX, TMP_PREFIX))):
        meta_path = d / META
        meta: dict[str, Any] = {}
        if meta_path.is_file():
            try:
                meta = msgspec.json.decode(meta_path.read_bytes())
            except msgspec.DecodeError:
                meta = {}
        if not meta or d.name.startswith(TMP_PREFIX):
            out.append(CheckpointInfo(name=d.name, complete=False))
            continue
        out.append(CheckpointInfo(name=d.name, complete=True, step=meta.get("step"),
                                  loss=meta.get("loss"), healthy=meta.get("healthy"),
                                  save_s=meta.get("save_s"),
                                  problem=None if meta.get("healthy") else meta.get("reason")))
    picked = False
    for i in reversed(range(len(out))):
        c = out[i]
        if not (c.complete and c.healthy):
            continue
        try:
            if picked:
                check_files(root / c.name)  # cheap: files and headers
            else:
                verify(root / c.name)  # what resume = "auto" does: every tensor read
                out[i] = msgspec.structs.replace(c, auto_resume=True)
                picked = True
        except CheckpointError as exc:
            out[i] = msgspec.structs.replace(c, problem=str(exc))
    return out


def scan_archives(run_dir: Path) -> dict[str, int]:
    """``{archive directory name: checkpoints in it}`` for ``run_dir/checkpoints/archive-*``."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return {}
    return {d.name: sum(1 for c in d.iterdir() if c.name.startswith(PREFIX))
            for d in sorted(root.glob(ARCHIVE_PREFIX + "*")) if d.is_dir()}
