"""Which checkpoint a run continues from, proof that it can be trusted, and one lineage per directory.

The rules (docs/running.md, "Resume"):

* **Verified before use.** A checkpoint is resumable when ``meta.json`` marks it healthy, every file
  of :data:`dflash.checkpoint.format.REQUIRED_FILES` is present and readable, and every floating-point
  tensor — weights and optimizer moments — is finite (:func:`verify` reads them all).
* **auto** takes the newest checkpoint of ``RUN_DIR/checkpoints`` that passes; every newer one it
  passes over is returned in :attr:`Resume.rejected` with the reason, for a loud log line. An
  explicit path that fails is an error (no silent substitute for what was asked).
* **One lineage per directory.** ``checkpoints/`` only holds the checkpoints the current run
  descends from: a fresh start moves every existing checkpoint, and a resume from step S moves the
  ones newer than S or of another lineage, to ``checkpoints/archive-<UTC time>/``
  (:func:`archive_foreign`). Nothing is deleted, and retention (which only removes checkpoints of
  its own lineage) cannot mistake an old run's checkpoints for the new run's.
* **Changed config named.** :func:`dflash.checkpoint.config_changes.config_changes` lists the keys whose value differs from the
  checkpoint's ``train_config.json`` and what each one changes (schedule, data order, shapes).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.checkpoint.config_changes import saved_config
from dflash.checkpoint.format import (
    ARCHIVE_PREFIX,
    DRAFTER_CONFIG,
    PREFIX,
    RANK_STATE,
    WEIGHTS,
    CheckpointError,
    check_files,
    is_healthy,
    list_checkpoints,
    load_train_state,
    nonfinite_tensors,
    rank_state_files,
    read_meta,
    run_dir_checkpoints,
)

if TYPE_CHECKING:  # a real import would load the models, which the run-directory reports never need
    from dflash.model.drafter import DrafterConfig

log = logging.getLogger("dflash.resume")

_STATE_KEYS = ("step", "optimizer", "scheduler", "sampler", "rng")


@dataclass
class Resume:
    """A verified checkpoint, loaded.

    Attributes:
        path: the checkpoint directory.
        meta: its ``meta.json``.
        weights: ``model.safetensors`` on the CPU (name -> tensor, as saved).
        train_state: ``train_state.pt`` with its tensors (optimizer, scheduler, sampler, RNG, step).
        rejected: ``(path, reason)`` of every newer checkpoint that ``auto`` passed over.
    """

    path: Path
    meta: dict[str, Any]
    weights: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    rejected: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.train_state["step"])

    @property
    def lineage(self) -> str | None:
        return self.meta.get("lineage")


def verify(path: Path) -> Resume:
    """Load a checkpoint and check everything a resume needs (see the module docstring):
    :func:`check_files`, then every tensor of the weights and the train state read and finite.

    Raises:
        CheckpointError: the reason it cannot be used (one line: which file, which tensors).
    """
    from safetensors.torch import load_file

    path = Path(path)
    meta = check_files(path)
    try:
        weights = load_file(str(path / WEIGHTS))
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: an unusable file
        raise CheckpointError(f"{WEIGHTS} is unreadable ({exc})") from exc
    bad = nonfinite_tensors(weights)
    if bad:
        raise CheckpointError(f"non-finite weights in model.safetensors ({', '.join(b.lstrip('/') for b in bad[:3])}"
                              f"{' ...' if len(bad) > 3 else ''})")
    state = load_train_state(path)  # CheckpointError names the unreadable part
    absent = [k for k in _STATE_KEYS if k not in state] if isinstance(state, dict) else list(_STATE_KEYS)
    if absent:
        raise CheckpointError(f"train_state.pt lacks {', '.join(absent)}")
    bad = nonfinite_tensors(state)
    if bad:
        raise CheckpointError(f"non-finite train state ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
    if meta.get("step") is not None and int(state["step"]) != int(meta["step"]):
        raise CheckpointError(f"train_state.pt is at step {state['step']} but meta.json says {meta['step']}")
    return Resume(path=path, meta=meta, weights=weights, train_state=state)


def check_resume_path(resume: str) -> None:
    """A cheap look at an explicit ``--resume PATH`` (no tensor read), made before any data work.

    Raises:
        CheckpointError: ``resume`` is not "auto"/"none" and names no directory, or names a run
            directory (one holding ``checkpoints/``) instead of one of its checkpoints.
    """
    if resume in ("auto", "none"):
        return
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory; give a checkpoint "
                              "directory (python -m dflash.logs RUN_DIR lists them), auto or none")
    steps = run_dir_checkpoints(path)
    if steps is not None:
        # the example must be usable: the newest complete, healthy one (files and headers checked,
        # as resume = "auto" first does), never an empty or interrupted step_* directory
        usable = next((p for p in reversed(steps) if is_healthy(p)), None)
        if usable is not None:
            raise CheckpointError(f"--resume {resume} is a run directory; give one of its checkpoints, "
                                  f"e.g. --resume {usable}, or --resume auto with run.out_dir = {resume} "
                                  "(its newest healthy one)")
        raise CheckpointError(f"--resume {resume} is a run directory and holds no complete, healthy "
                              "checkpoint to resume from (python -m dflash.logs "
                              f"{resume} says why); give another checkpoint, or --resume none to start fresh")


def choose(run_dir: Path, resume: str) -> Resume | None:
    """The verified checkpoint to resume from.

    Args:
        run_dir: the run directory (checkpoints live in ``run_dir/checkpoints``).
        resume: ``"none"`` (start fresh), ``"auto"`` (the newest checkpoint that passes
            :func:`verify`, or none), or a path to a checkpoint directory.

    Returns:
        The loaded checkpoint, with the newer ones ``auto`` rejected and why (each also logged as a
        ``REJECTED checkpoint PATH: reason`` warning); None to start fresh.

    Raises:
        CheckpointError: a given path does not exist or fails :func:`verify` (the message names the
            nearest healthy checkpoint beside it, or says there is none).
    """
    if resume == "none":
        return None
    if resume == "auto":
        rejected: list[tuple[Path, str]] = []
        for path in reversed(list_checkpoints(Path(run_dir) / "checkpoints")):
            try:
                got = verify(path)
            except CheckpointError as exc:
                log.warning("REJECTED checkpoint %s: %s; trying an older one", path, exc)
                rejected.append((path, str(exc)))
                continue
            got.rejected = rejected
            return got
        if rejected:
            log.warning("no usable checkpoint in %s; starting from step 0", Path(run_dir) / "checkpoints")
        return None
    check_resume_path(resume)
    path = Path(resume)
    try:
        return verify(path)
    except CheckpointError as exc:
        reason = str(exc)
    near = _healthy_beside(path)
    if near is not None:
        raise CheckpointError(f"--resume {resume}: cannot be used: {reason}; give --resume {near} instead "
                              "(the nearest healthy checkpoint beside it) or --resume auto")
    raise CheckpointError(f"--resume {resume}: cannot be used: {reason}; there is no healthy checkpoint beside "
                          f"it in {path.parent}: give another checkpoint, or --resume none to start fresh")


def _healthy_beside(path: Path) -> Path | None:
    """The checkpoint beside ``path`` (same directory) nearest to it in step that passes
    :func:`is_healthy` (files and headers; the older one on a tie), or None."""
    def step(p: Path) -> int:
        digits = p.name.removeprefix(PREFIX)
        return int(digits) if digits.isdigit() else -1

    here = step(path)
    others = [p for p in list_checkpoints(path.parent) if p.resolve() != path.resolve()]
    others.sort(key=lambda p: (abs(step(p) - here), step(p)))
    return next((p for p in others if is_healthy(p)), None)


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """The path :func:`choose` picks (``None``: start fresh). Raises CheckpointError like it."""
    got = choose(run_dir, resume)
    return got.path if got is not None else None


def new_lineage() -> str:
    """A fresh lineage id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def archive_foreign(root: Path, resumed: Resume | None) -> tuple[Path | None, list[str]]:
    """Move every checkpoint under ``root`` that the run does not descend from to
    ``root/archive-<UTC time>/`` (with its ``rank_state`` files): all of them for a fresh start
    (``resumed`` None); for a resume from step S, those newer than S or of another lineage.

    Returns:
        ``(archive directory or None when nothing moved, names moved)``.
    """
    root = Path(root)
    keep_lineage, upto = (resumed.lineage, resumed.step) if resumed is not None else (None, -1)
    moving = []
    for path in list_checkpoints(root):
        if resumed is not None and path.resolve() == resumed.path.resolve():
            continue
        meta = read_meta(path)
        ours = (resumed is not None and meta is not None and meta.get("lineage") == keep_lineage
                and isinstance(meta.get("step"), int) and meta["step"] <= upto)
        if not ours:
            moving.append(path)
    if not moving:
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = root / f"{ARCHIVE_PREFIX}{stamp}"
    n = 2
    while dest.exists():
        dest, n = root / f"{ARCHIVE_PREFIX}{stamp}-{n}", n + 1
    dest.mkdir()
    for path in moving:
        path.rename(dest / path.name)
        for rank_file in rank_state_files(root, path.name):
            (dest / RANK_STATE).mkdir(exist_ok=True)
            rank_file.rename(dest / RANK_STATE / rank_file.name)
    return dest, [p.name for p in moving]


SHAPE_KEYS = ("num_layers", "block_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "target_layer_ids", "layer_types")
"""The drafter config keys that fix its tensor shapes (a resume cannot change them)."""
DFLASH2_SHAPE_KEYS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")
"""DFlash2's extra keys that fix its tensor shapes, compared when both sides are DFlash2."""


def resume_candidate(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint ``resume`` would most likely continue from, found without reading any tensor:
    the given path, the newest complete healthy checkpoint (:func:`is_healthy`) for ``"auto"``, or
    None. Used to check its architecture before any data work; :func:`choose` then verifies the
    tensors and may fall back to an older one, which is checked again."""
    if resume == "none":
        return None
    if resume != "auto":
        return Path(resume)
    return next((p for p in reversed(list_checkpoints(Path(run_dir) / "checkpoints")) if is_healthy(p)), None)


def check_architecture(ckpt: Path, drafter_cfg: DrafterConfig) -> None:
    """Check that the checkpoint's ``drafter_config.json`` has the shape of ``drafter_cfg`` (a
    :class:`dflash.model.drafter.DrafterConfig`); nothing to check when the file is unreadable.

    Raises:
        CheckpointError: names the variant (DFlash or DFlash2) and each :data:`SHAPE_KEYS` key
            (and, between DFlash2 drafters, :data:`DFLASH2_SHAPE_KEYS` key) that differs, and ``confidence_head``
            (whether the weights hold DSpark's confidence head), and what to do.
    """
    import msgspec

    try:
        saved = json.loads((Path(ckpt) / DRAFTER_CONFIG).read_text())
    except (OSError, ValueError):
        return
    now = msgspec.to_builtins(drafter_cfg)
    # a checkpoint written before DFlash2 existed has no "variant": it is a DFlash drafter
    variants = saved.get("variant", "dflash"), now.get("variant", "dflash")
    diff = [] if variants[0] == variants[1] else [
        f"variant: checkpoint {variants[0]!r}, config {variants[1]!r} (drafter.variant)"]
    keys = SHAPE_KEYS + (DFLASH2_SHAPE_KEYS if variants == ("dflash2", "dflash2") else ())
    diff += [f"{k}: checkpoint {saved.get(k)!r}, config {now.get(k)!r}" for k in keys
             if k in saved and saved.get(k) != now.get(k)]
    if saved.get("confidence_head", False) != now.get("confidence_head", False):
        # the head's weights are in model.safetensors or not: loss.confidence cannot change on resume
        diff.append(f"confidence_head (loss.confidence = 'head'): checkpoint {saved.get('confidence_head', False)!r}, "
                    f"config {now.get('confidence_head', False)!r}")
    if diff:
        raise CheckpointError(
            f"checkpoint {ckpt} has another drafter shape ({'; '.join(diff)}); resume it with its own "
            "config, or start fresh with --resume none or another run.out_dir"
        )


def check_optimizer(ckpt: Path, optimizer: str) -> None:
    """Check that the checkpoint was trained with ``[train].optimizer = optimizer``: AdamW's moments
    and Muon's momentum are different state, and neither continues from the other. Nothing to
    check when the checkpoint has no readable ``train_config.json`` (older checkpoints: AdamW).

    Raises:
        CheckpointError: the optimizers differ; names both and what to do.
    """
    config = saved_config(ckpt)
    if config is None:
        return
    saved = (config.get("train") or {}).get("optimizer", "adamw")
    if saved != optimizer:
        raise CheckpointError(
            f"checkpoint {ckpt} was trained with train.optimizer = {saved!r}, and this run sets {optimizer!r} "
            f"(their states do not carry over): set train.optimizer = {saved!r} to resume, or start fresh "
            "with --resume none or another run.out_dir")
