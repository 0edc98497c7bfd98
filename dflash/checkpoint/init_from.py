"""``[train].init_from``: a warm start, the drafter of a fresh run starting from an existing
drafter's weights instead of its seeded random init.

The directory is one of two kinds:

* a dflash checkpoint (``RUN/checkpoints/step_N``): ``drafter_config.json`` and
  ``model.safetensors`` (:mod:`dflash.checkpoint.model_files`); its optimizer state is not read;
* a public-layout directory: ``config.json`` naming a drafter's ``architectures`` and
  ``model.safetensors`` (``python -m dflash.export`` output, z-lab's DFlash and DFlash2 drafters;
  read by :mod:`dflash.model.public_layout`).

Only the weights carry over; the optimizer and the learning-rate schedule start fresh.
:func:`check_init_from` is the run's check before any data work (``dflash.run.validate``, only
when no checkpoint of the run's own is to be resumed): the directory exists and is one of the two
kinds, its drafter has the run's architecture (:func:`dflash.checkpoint.resume.architecture_changes`)
and its weights file, read from its header alone, holds every tensor of that drafter in its shape;
and it is not a checkpoint of the run's own directory, which the fresh start moves to an archive
(:func:`dflash.checkpoint.resume.archive_foreign`) before the drafter is built.
:func:`load_init_from` makes the same checks and loads every tensor, in fp32 (the drafter stage's
setup, between building the drafter and wrapping it for data parallelism).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash.checkpoint.format import (
    DRAFTER_CONFIG,
    PREFIX,
    WEIGHTS,
    is_healthy,
    nonfinite_tensors,
    run_dir_checkpoints,
)
from dflash.checkpoint.resume import architecture_changes, saved_drafter_config, tensor_shapes
from dflash.errors import ConfigError
from dflash.model.drafter_config import DrafterConfig
from dflash.model.public_layout import (
    CONFIG,
    exported_config,
    exported_shapes,
    exported_state_dict,
)

if TYPE_CHECKING:
    from dflash.model.drafter import DFlashDrafter

__all__ = ["KEY", "check_init_from", "init_from_config", "load_init_from"]

KEY = "train.init_from"

_KINDS = (f"a dflash checkpoint directory (RUN/checkpoints/step_N: {DRAFTER_CONFIG} and {WEIGHTS}) or an "
          f"exported drafter ({CONFIG} and {WEIGHTS}: python -m dflash.export output, a z-lab drafter)")


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def init_from_config(path: str | Path) -> DrafterConfig:
    """The drafter config the directory ``path`` holds: its ``drafter_config.json`` (a dflash
    checkpoint; keys this version lacks are dropped, keys added since take their defaults) or its
    ``config.json`` (:func:`dflash.model.public_layout.exported_config`). Reads no tensor.

    Raises:
        ConfigError: one line naming ``train.init_from``: the path does not exist, is a file, is a
            run directory (naming its newest healthy checkpoint), is neither kind of drafter
            directory, or its config is unreadable or names no drafter.
    """
    d = Path(path)
    key = f"{KEY} = {str(path)!r}"
    if not d.exists():
        raise ConfigError(f"{key} does not exist: give {_KINDS}, or leave {KEY} out")
    if not d.is_dir():
        raise ConfigError(f"{key} is a file, not a directory: give {_KINDS}")
    steps = run_dir_checkpoints(d)
    if steps is not None:
        usable = next((p for p in reversed(steps) if is_healthy(p)), None)
        hint = (f"e.g. {KEY} = {str(usable)!r}" if usable is not None else
                "it holds no complete, healthy checkpoint (python -m dflash.logs says why)")
        raise ConfigError(f"{key} is a run directory: give one of its checkpoints, {hint}")
    if (d / DRAFTER_CONFIG).is_file() and (d / WEIGHTS).is_file():
        try:
            # written before num_anchors moved to [train], or by a newer version: only today's keys
            return saved_drafter_config(json.loads((d / DRAFTER_CONFIG).read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{key}: {d / DRAFTER_CONFIG} is unreadable ({_line(exc)}); the checkpoint is "
                              f"damaged: point {KEY} at another step") from None
    if (d / CONFIG).is_file() and (d / WEIGHTS).is_file():
        try:
            return exported_config(d)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{key} holds no drafter: {_line(exc)}; give {_KINDS}") from None
    present = [n for n in (DRAFTER_CONFIG, CONFIG, WEIGHTS) if (d / n).is_file()]
    holds = f"it holds {' and '.join(present)} only" if present else f"it holds none of {DRAFTER_CONFIG}, {CONFIG}, {WEIGHTS}"
    raise ConfigError(f"{key} is not a drafter directory ({holds}): give {_KINDS}")


def check_init_from(path: str | Path, drafter: DrafterConfig, *, run_dir: str | Path | None = None) -> list[str]:
    """Check that ``path`` holds a drafter whose weights a run of the resolved ``drafter`` can
    start from (see the module docstring); reads the weights file's header, no tensor.

    Args:
        run_dir: the run's ``run.out_dir``, when the run starts fresh there: a fresh start moves
            every checkpoint of ``run_dir/checkpoints`` to an archive before the drafter is built,
            so ``path`` must not be one of them.

    Returns:
        Warnings (one line each) for a drafter that fits but was trained on other target features:
        other ``target_layer_ids`` (same count) or another ``mask_token_id``.

    Raises:
        ConfigError: one line naming ``train.init_from`` (:func:`init_from_config`'s reasons), or
            its drafter differs from ``drafter`` in variant, block size or a tensor's shape (each
            differing field named, ``num_layers: init_from 1, config 3``), or its
            ``model.safetensors`` is unreadable or lacks, adds or reshapes a tensor of it, or
            ``path`` is one of ``run_dir``'s checkpoints.
    """
    then = init_from_config(path)
    key = f"{KEY} = {str(path)!r}"
    if run_dir is not None and _archived_on_a_fresh_start(Path(path), Path(run_dir)):
        raise ConfigError(f"{key} is a checkpoint of this run's own directory, and a fresh start moves those to "
                          f"checkpoints/archive-*/ before the drafter is built: copy it out of run.out_dir = "
                          f"{str(run_dir)!r} and point {KEY} at the copy, or give the run another run.out_dir")
    diff = [d.replace(": checkpoint ", ": init_from ") for d in architecture_changes(then, drafter)]
    if diff:
        raise ConfigError(f"{key} holds a drafter of another architecture than this run's ({'; '.join(diff)}): "
                          "give this run's [drafter] its values (the target fixes hidden_size), "
                          f"or point {KEY} at a drafter of this run's architecture")
    try:
        have = exported_shapes(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {_line(exc)}; give another drafter directory") from None
    problems = _shape_problems(have, tensor_shapes(drafter))
    if problems:
        raise ConfigError(f"{key}: {WEIGHTS} does not match this run's drafter ({'; '.join(problems)}); the "
                          "weights do not match the directory's own config: give another drafter directory")
    return _feature_warnings(key, then, drafter)


def load_init_from(drafter: DFlashDrafter, path: str | Path) -> int:
    """Load every tensor of the drafter directory ``path`` into ``drafter`` (strict: none missing,
    none extra), each as fp32, after :func:`check_init_from`'s checks against ``drafter.cfg``.

    Returns:
        The number of tensors loaded.

    Raises:
        ConfigError: :func:`check_init_from`'s reasons, or a weight that is NaN or infinite.
    """
    check_init_from(path, drafter.cfg)
    key = f"{KEY} = {str(path)!r}"
    try:
        weights = exported_state_dict(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {_line(exc)}; give another drafter directory") from None
    bad = nonfinite_tensors(weights)
    if bad:
        raise ConfigError(f"{key}: non-finite weights ({', '.join(b.lstrip('/') for b in bad[:3])}"
                          f"{' ...' if len(bad) > 3 else ''}): give another drafter directory")
    weights = {k: t.float() if t.is_floating_point() else t for k, t in weights.items()}
    with torch.no_grad():
        drafter.load_state_dict(weights, strict=True)
    return len(weights)


def _archived_on_a_fresh_start(path: Path, run_dir: Path) -> bool:
    """Whether ``path`` is, or lies in, a checkpoint of ``run_dir/checkpoints`` (a ``step_*``
    directory there: what :func:`dflash.checkpoint.resume.archive_foreign` moves on a fresh start)."""
    root = (run_dir / "checkpoints").resolve()
    here = path.resolve()
    if not here.is_relative_to(root) or here == root:
        return False
    return here.relative_to(root).parts[0].startswith(PREFIX)


def _shape_problems(have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> list[str]:
    """Up to three of: a tensor missing from the file, one the drafter lacks, one of another shape."""
    out = [f"missing {k}" for k in sorted(want.keys() - have.keys())]
    out += [f"unexpected {k}" for k in sorted(have.keys() - want.keys())]
    out += [f"{k}: {list(have[k])} in the file, {list(want[k])} here" for k in sorted(want.keys() & have.keys())
            if have[k] != want[k]]
    return out[:3] + ([f"{len(out) - 3} more"] if len(out) > 3 else [])


def _feature_warnings(key: str, then: DrafterConfig, now: DrafterConfig) -> list[str]:
    out = []
    if list(then.target_layer_ids or []) != list(now.target_layer_ids or []):
        out.append(f"{key} was trained on target layers {list(then.target_layer_ids or [])}, this run feeds "
                   f"{list(now.target_layer_ids or [])} (target.layer_ids): its weights load, but start on other features")
    if then.mask_token_id is not None and then.mask_token_id != now.mask_token_id:
        out.append(f"{key} drafts with mask token {then.mask_token_id}, this run with {now.mask_token_id} "
                   "(drafter.mask_token_id): its weights load, but were trained with another mask token")
    return out
