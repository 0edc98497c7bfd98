"""The health of a run's checkpoints, as ``python -m dflash.logs`` reports it.

Every ``checkpoints/step_*`` (and leftover ``.tmp-*``) directory with its ``meta.json`` health, and
which one ``resume = "auto"`` would pick: the newest complete healthy one whose files and tensors
pass :func:`dflash.checkpoint.resume.verify`; the newer ones are listed with why they were passed
over. ``checkpoints/archive-*`` directories (an earlier lineage moved aside) are counted only.

The rule for every reader of a checkpoint's weights outside resume (``dflash.eval``,
``dflash.export``): :func:`reader_problem` (marked ``healthy: false`` in ``meta.json``, or a NaN/Inf
in ``model.safetensors``) refuses it, naming :func:`nearest_healthy`; resume applies the stricter
:func:`dflash.checkpoint.resume.verify` (the train state too).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from dflash.checkpoint.format import (
    ARCHIVE_PREFIX,
    META,
    PREFIX,
    REQUIRED_FILES,
    TMP_PREFIX,
    WEIGHTS,
    is_healthy,
    list_checkpoints,
    read_meta,
)

__all__ = ["CheckpointInfo", "nearest_healthy", "nonfinite_weights", "reader_problem", "scan_archives",
           "scan_checkpoints"]


META_UNREADABLE = (f"{META} is unreadable or damaged (not a JSON object with a boolean 'healthy' and an integer "
                   "'step'): an interrupted, torn or overwritten save")
"""What :func:`reader_problem` and :func:`scan_checkpoints` say of a ``meta.json`` that
:func:`~dflash.checkpoint.format.read_meta` does not accept."""
TMP_PROBLEM = "incomplete (a save in progress or interrupted; resume ignores it)"
"""What :func:`scan_checkpoints` says of a leftover ``.tmp-*`` directory."""


def nonfinite_weights(path: Path, limit: int = 3) -> list[str]:
    """Names (up to ``limit``) of the floating-point tensors of ``path/model.safetensors`` holding a
    NaN or an Inf; read one tensor at a time. An unreadable file gives none here (loading it
    reports that)."""
    import torch
    from safetensors import safe_open

    bad: list[str] = []
    try:
        with safe_open(str(Path(path) / WEIGHTS), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                t = f.get_tensor(name)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    bad.append(name)
                    if len(bad) >= limit:
                        break
    except Exception:  # noqa: BLE001 - SafetensorError, OSError: the loader names an unusable file
        return []
    return bad


def reader_problem(path: Path) -> str | None:
    """Why the weights of checkpoint ``path`` must not be trusted, or None: ``meta.json`` says
    ``healthy: false`` (with its reason), or ``model.safetensors`` holds NaN/Inf (names them). A
    checkpoint without ``meta.json`` (weights and configs copied alone) is judged by its tensors;
    one whose ``meta.json`` exists but does not parse is damaged (a torn or overwritten save), as
    ``--resume`` also judges it."""
    meta = read_meta(Path(path))
    if meta is None and (Path(path) / META).exists():
        return META_UNREADABLE
    if meta is not None and meta.get("healthy") is False:
        return f"marked unhealthy ({meta.get('reason') or 'no reason recorded'})"
    bad = nonfinite_weights(path)
    if bad:
        return f"non-finite weights in {WEIGHTS} ({', '.join(bad)})"
    return None


def _step(path: Path) -> int | None:
    meta = read_meta(path) or {}
    if isinstance(meta.get("step"), int):
        return meta["step"]
    digits = path.name.removeprefix(PREFIX)
    return int(digits) if digits.isdigit() else None


def nearest_healthy(path: Path) -> Path | None:
    """The sibling checkpoint (same ``checkpoints/`` directory) nearest in step to ``path`` that is
    complete, marked healthy and has finite weights (:func:`reader_problem`); the older one on a tie.
    None when there is none."""
    path = Path(path)
    here = _step(path)
    others = [p for p in list_checkpoints(path.parent) if p.resolve() != path.resolve()]
    if here is not None:
        others.sort(key=lambda p: (abs((_step(p) or 0) - here), (_step(p) or 0)))
    else:
        others.reverse()
    for p in others:
        if is_healthy(p) and reader_problem(p) is None:
            return p
    return None


class CheckpointInfo(msgspec.Struct, frozen=True):
    """One checkpoint directory: ``complete`` (a finished save: not ``.tmp-*``, with a readable
    meta.json), its step, loss, health, save time, the files of :data:`REQUIRED_FILES` it lacks,
    whether resume = "auto" would pick it, and why not."""

    name: str
    complete: bool
    step: int | None = None
    loss: float | None = None
    healthy: bool | None = None
    save_s: float | None = None
    auto_resume: bool = False
    problem: str | None = None  # why resume = "auto" would not use it (None: usable, or not checked);
    # for an incomplete one, what is wrong (None: no meta.json)
    missing: tuple[str, ...] = ()  # required files absent (a meta.json alone, a deleted train_state.pt)


def scan_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every ``step_*`` and ``.tmp-*`` directory under ``run_dir/checkpoints``, sorted by name, with
    its health and, by resume = "auto"'s rule, which one it would pick (module docstring)."""
    from dflash.checkpoint import CheckpointError, check_files, verify

    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith((PREFIX, TMP_PREFIX))):
        if d.name.startswith(TMP_PREFIX):
            out.append(CheckpointInfo(name=d.name, complete=False, problem=TMP_PROBLEM))
            continue
        meta_path = d / META
        if not meta_path.exists():
            out.append(CheckpointInfo(name=d.name, complete=False))  # no meta.json: incomplete
            continue
        meta = read_meta(d)
        if meta is None:  # as reader_problem and --resume judge it
            out.append(CheckpointInfo(name=d.name, complete=False, problem=META_UNREADABLE))
            continue
        missing = tuple(f for f in REQUIRED_FILES if not (d / f).is_file())
        out.append(CheckpointInfo(name=d.name, complete=True, step=meta.get("step"),
                                  loss=meta.get("loss"), healthy=meta.get("healthy"),
                                  save_s=meta.get("save_s"), missing=missing,
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
