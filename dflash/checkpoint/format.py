"""What a checkpoint directory holds, its file names, and how it is read and validated.

Layout of one checkpoint (see docs/architecture.md)::

    RUN_DIR/checkpoints/step_00000100/
        model.safetensors        drafter weights (public DFlash parameter names)      WEIGHTS
        drafter_config.json      the resolved DrafterConfig                            DRAFTER_CONFIG
        target_config.json       the TargetConfig the drafter was trained against      TARGET_CONFIG
        train_state.safetensors  optimizer moments (and any other tensor of the train state)
        train_state.pt           the rest: scheduler, sampler and RNG state, step, references
        train_config.json        the resolved graph file the run trained with           TRAIN_CONFIG
        meta.json                :class:`Meta`, written last                           META
    RUN_DIR/checkpoints/rank_state/step_00000100.rank1.pt   per-replica train state (DDP runs)
    RUN_DIR/checkpoints/.tmp-step_00000100/                 a save in progress (never read)
    RUN_DIR/checkpoints/archive-<UTC time>/                 checkpoints of another lineage

:mod:`dflash.checkpoint.writer` writes this layout, :mod:`dflash.checkpoint.resume` chooses and
verifies a checkpoint to continue from; :mod:`dflash.checkpoint.model_files` reads the model part.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import torch

from csp.cuda.tensors import iter_tensors, map_tensors
from dflash.errors import CheckpointError

PREFIX = "step_"
"""Name prefix of a checkpoint directory (``step_00000100``)."""
TMP_PREFIX = ".tmp-"
"""Name prefix of a save in progress; resume ignores it and the next save removes it."""
ARCHIVE_PREFIX = "archive-"
"""Name prefix of a directory of checkpoints moved aside (:func:`dflash.checkpoint.resume.archive_foreign`)."""
RANK_STATE = "rank_state"
"""Directory, under the checkpoints root, of the per-replica train states of a data-parallel run."""

META = "meta.json"
WEIGHTS = "model.safetensors"
DRAFTER_CONFIG = "drafter_config.json"
TARGET_CONFIG = "target_config.json"
TRAIN_STATE = "train_state.pt"
TRAIN_TENSORS = "train_state.safetensors"
TRAIN_CONFIG = "train_config.json"
"""The resolved graph file a checkpoint was trained with (written by the drafter stage)."""

REQUIRED_FILES = (META, WEIGHTS, DRAFTER_CONFIG, TARGET_CONFIG, TRAIN_STATE, TRAIN_TENSORS)
"""Every file a checkpoint needs to be resumed, evaluated or exported."""


class Meta(msgspec.Struct, kw_only=True):
    """``meta.json``: what the writer knew when it saved (field order is the file's key order).

    Attributes:
        step, batch_id: the step trained last and the batch it trained on.
        loss: mean loss of the checkpoint's window (the steps since the previous checkpoint, skipped
            ones excluded); NaN (``null`` on disk) when every one was skipped.
        window_steps, window_skipped: steps in that window, and how many were skipped.
        skipped_total: skipped steps of the whole run so far.
        healthy, reason: the health verdict (:func:`dflash.checkpoint.snapshot.health_reason`).
        lineage: id of the run lineage that wrote it; config_hash: hash of the resolved graph file.
        time: unix seconds when written; save_s: seconds from snapshot to ``meta.json``.
    """

    step: int
    batch_id: int
    loss: float | None
    window_steps: int = 0
    window_skipped: int = 0
    skipped_total: int = 0
    healthy: bool
    reason: str | None = None
    lineage: str | None = None
    config_hash: str | None = None
    time: float = 0.0
    save_s: float = 0.0


def step_dir(root: Path, step: int) -> Path:
    """``root/step_00000100`` for step 100."""
    return root / f"{PREFIX}{step:08d}"


def rank_state_path(ckpt_root: str | Path, step: int, replica: int) -> Path:
    """``CKPT_ROOT/rank_state/step_<step:08d>.rank<replica>.pt``."""
    return Path(ckpt_root) / RANK_STATE / f"{PREFIX}{step:08d}.rank{replica}.pt"


def rank_state_files(ckpt_root: str | Path, name: str) -> list[Path]:
    """The per-replica state files of checkpoint directory ``name`` (``step_00000100``)."""
    return sorted((Path(ckpt_root) / RANK_STATE).glob(f"{name}.rank*.pt"))


def read_rank_state(ckpt_root: str | Path, step: int, replica: int) -> dict[str, Any] | None:
    """Replica ``replica``'s state saved at ``step``, or None if there is none (a checkpoint written
    by a run with fewer drafter ranks)."""
    path = rank_state_path(ckpt_root, step, replica)
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def is_checkpoint_dir(path: Path) -> bool:
    """True when ``path`` holds a training checkpoint's own files (``meta.json`` or ``train_state.pt``)."""
    return (Path(path) / META).exists() or (Path(path) / TRAIN_STATE).exists()


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root`` (complete or not, no ``.tmp-*``), oldest step first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(dirs, key=lambda p: p.name)


def run_dir_checkpoints(path: Path) -> list[Path] | None:
    """When ``path`` is a run directory (it holds ``checkpoints/``) rather than a checkpoint: its
    checkpoint directories, oldest step first (maybe none yet); else None. For the one-line
    "give one of its checkpoints" errors of ``--resume``, ``dflash.eval`` and ``dflash.export``."""
    root = Path(path) / "checkpoints"
    return list_checkpoints(root) if root.is_dir() else None


META_DAMAGED = (f"{META} is missing or unreadable, or damaged (not a JSON object with a boolean 'healthy' and "
                "an integer 'step'): an interrupted, torn or overwritten save")
"""What every reader says of a checkpoint whose ``meta.json`` :func:`read_meta` does not accept."""


def read_meta(path: Path) -> dict[str, Any] | None:
    """``meta.json`` of a checkpoint, or None if it is missing, unreadable or damaged: anything but
    a JSON object with a boolean ``healthy`` and an integer ``step`` (a list, ``{}``,
    ``{"healthy": "no"}``, bytes that are not UTF-8). The one rule of every reader (resume,
    ``dflash.eval``, ``dflash.export``, ``dflash.logs``), so they judge a damaged file alike."""
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("healthy"), bool):
        return None
    step = meta.get("step")
    return meta if isinstance(step, int) and not isinstance(step, bool) else None


def check_files(path: Path) -> dict[str, Any]:
    """The cheap part of :func:`dflash.checkpoint.resume.verify`: ``meta.json`` marks the checkpoint healthy,
    every file of :data:`REQUIRED_FILES` is present, the configs parse and the safetensors headers
    cover their files (no tensor data read). Returns ``meta.json``.

    Raises:
        CheckpointError: the reason it cannot be used.
    """
    from safetensors import safe_open

    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(META_DAMAGED)
    if not meta["healthy"]:
        raise CheckpointError(f"marked unhealthy ({meta.get('reason') or 'no reason recorded'})")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{', '.join(missing)} missing")
    for name in (DRAFTER_CONFIG, TARGET_CONFIG):
        try:
            json.loads((path / name).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{name} is unreadable ({exc})") from exc
    for name in (WEIGHTS, TRAIN_TENSORS):
        try:
            with safe_open(str(path / name), "pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: an unusable file
            raise CheckpointError(f"{name} is unreadable ({exc})") from exc
    return meta


def is_healthy(path: Path) -> bool:
    """True if :func:`check_files` passes: complete, marked healthy, every file present, configs and
    safetensors headers readable (``safe_open`` checks that a file is as long as its header says: a
    truncated copy fails). Cheap: no tensor data is read; :func:`dflash.checkpoint.resume.verify` reads it."""
    try:
        check_files(path)
    except CheckpointError:
        return False
    return True


def load_train_state(path: Path) -> dict[str, Any]:
    """The ``train_state.pt`` of a checkpoint (optimizer, scheduler, sampler, RNG, counters), its
    tensor references filled from ``train_state.safetensors``.

    Raises:
        CheckpointError: a file is missing, truncated or unreadable, or a referenced tensor is absent
            (the message names the file, not the checkpoint: the caller does).
    """
    from safetensors.torch import load_file

    try:
        skeleton = torch.load(path / TRAIN_STATE, map_location="cpu", weights_only=False)
        big = path / TRAIN_TENSORS
        tensors = load_file(str(big)) if big.is_file() else {}
        return _join_tensors(skeleton, tensors)
    except KeyError as exc:
        raise CheckpointError(f"train_state.pt refers to tensor {exc}, which is not in "
                              "train_state.safetensors") from exc
    except Exception as exc:  # noqa: BLE001 - unpickling/safetensors/OS errors: an unusable file
        # The first sentence only: torch's zip errors run on for several more.
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
        raise CheckpointError(f"train_state.pt or train_state.safetensors is unreadable ({first})") from exc


def nonfinite_tensors(tree: Any, path: str = "") -> list[str]:
    """Paths (``/optimizer/state/0/exp_avg``) of the floating-point tensors in a nested structure
    that hold a NaN or an Inf."""
    return [slash_path(p, path) or "tensor" for p, t in iter_tensors(tree, paths=True)
            if t.is_floating_point() and not torch.isfinite(t).all()]


def slash_path(path: tuple, prefix: str = "") -> str:
    """``/optimizer/state/0`` for the :func:`csp.cuda.tensors.iter_tensors` path ``("optimizer", "state", 0)``."""
    return prefix + "".join(f"/{key}" for key in path)


_TENSOR_REF = "__safetensors__:"


def _split_tensors(obj: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested structure by a reference and collect it in ``out``."""

    def ref(p: tuple, t: torch.Tensor) -> str:
        key = slash_path(p, path)
        out[key] = t.contiguous()
        return _TENSOR_REF + key

    return map_tensors(ref, obj, paths=True)


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`_split_tensors`."""
    if isinstance(obj, str) and obj.startswith(_TENSOR_REF):
        return tensors[obj[len(_TENSOR_REF):]]
    if isinstance(obj, dict):
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj

