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
    """Check that the checkpoint's ``drafter_config.json`` describes the drafter ``drafter_cfg`` (a
    :class:`dflash.model.drafter.DrafterConfig`) would build; nothing to check when the file is
    unreadable (the loader names it).

    The rule holds for every variant by construction: both configs build their drafter on the meta
    device (no memory, no init) and every tensor's name and shape are compared, so a field of a
    variant added later is checked without being listed here. Beside the shapes, the variant and the
    block size a drafter trains at (``trained_block_size``: what it is served at) must agree.

    Raises:
        CheckpointError: names the variant, and each field that changes a tensor's shape (alone),
            or else every differing field, and ``confidence_head`` (whether the weights hold
            DSpark's confidence head) as ``loss.confidence``, and what to do.
    """
    try:
        saved = json.loads((Path(ckpt) / DRAFTER_CONFIG).read_text())
        then = saved_drafter_config(saved)
    except (OSError, ValueError):
        return
    diff = architecture_changes(then, drafter_cfg)
    if diff:
        raise CheckpointError(
            f"checkpoint {ckpt} has another drafter shape ({'; '.join(diff)}); resume it with its own "
            "config, or start fresh with --resume none or another run.out_dir"
        )


def architecture_changes(then: DrafterConfig, now: DrafterConfig) -> list[str]:
    """What keeps weights trained as drafter ``then`` from training on as drafter ``now``, one
    ``"field: checkpoint X, config Y"`` each (empty: nothing)."""
    import msgspec

    out = []
    if then.variant != now.variant:
        out.append(f"variant: checkpoint {then.variant!r}, config {now.variant!r} (drafter.variant)")
    if then.block_size != now.block_size:  # no DFlash weight depends on it, but it is what the drafter is trained for
        out.append(f"block_size: checkpoint {then.block_size!r}, config {now.block_size!r}")
    try:
        before = tensor_shapes(then)
    except ValueError:  # not a resolved drafter config (a hand-made file): nothing more to compare
        return out
    if before == tensor_shapes(now):
        return out
    fields = [f for f in now.__struct_fields__ if f not in ("variant", "block_size")
              and getattr(then, f) != getattr(now, f)]

    def reshapes(f: str) -> bool:
        try:
            return tensor_shapes(msgspec.structs.replace(then, **{f: getattr(now, f)})) != before
        except ValueError:  # not a drafter alone (num_layers without its layer_types): it is part of the change
            return True

    named = [f for f in fields if reshapes(f)] or ([] if then.variant != now.variant else fields)
    for f in named:
        was, is_ = getattr(then, f), getattr(now, f)
        if f == "confidence_head":  # its weights are in model.safetensors or not: set by loss.confidence
            out.append(f"confidence_head (loss.confidence = 'head'): checkpoint {was!r}, config {is_!r}")
        else:
            out.append(f"{f}: checkpoint {was!r}, config {is_!r}")
    return out


def tensor_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """``{state-dict key: shape}`` of the drafter ``cfg`` builds, built on the meta device (no
    memory, no weight init, no random draw). The training switches that keep keys and shapes
    (kernels, compile, precision) are left at their plain values, so no optional package is needed."""
    import msgspec

    from dflash.model.drafter import DFlashDrafter

    plain = msgspec.structs.replace(cfg, kernels="torch", compile=False, precision="bf16",
                                    attn_implementation="sdpa")
    with torch.device("meta"):
        model = DFlashDrafter(plain)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def saved_drafter_config(saved: Any) -> DrafterConfig:
    """A checkpoint's ``drafter_config.json`` contents as a DrafterConfig (keys it no longer has,
    such as the older ``num_anchors``, dropped; keys added since take their defaults).

    Raises:
        ValueError: it is not a [drafter] table.
    """
    import msgspec

    from dflash.model.drafter import DrafterConfig

    if not isinstance(saved, dict):
        raise ValueError("not an object")
    try:
        return msgspec.convert({k: v for k, v in saved.items() if k in DrafterConfig.__struct_fields__},
                               DrafterConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


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
