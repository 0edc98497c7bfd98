"""What differs between a checkpoint's training config and the run's, and what each difference
does to training: the lines of a resume record's ``config_changes`` and of the resume log.

A checkpoint records the resolved graph file it trained with (``train_config.json``);
:func:`changes_since` compares it with the run's, key by key (:func:`config_changes`), naming each
changed key and its effect. Keys added to the config after a checkpoint was written take the value
that reproduces the older code (each such key says so on its own field:
:func:`dflash.tables.added_later`), so an unchanged setting is never reported.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Protocol

from dflash.checkpoint.format import TRAIN_CONFIG

__all__ = ["changes_since", "config_changes", "saved_config"]


class Resumed(Protocol):
    """What :func:`changes_since` reads of a :class:`dflash.checkpoint.resume.Resume`."""

    path: Path
    meta: dict[str, Any]


# Keys that change nothing about what is trained (where it is written, how it is watched).
_IGNORED = ("run.resume", "run.out_dir", "run.name", "monitor.", "trace.", "checkpoint.", "data.cache_dir",
            "data.num_workers", "train.max_nonfinite_streak", "train.check_channels", "train.host_staging",
            "train.postprocess_side", "train.init_from", "run.memory_check")  # init_from: a resume loads its checkpoint
# First matching prefix wins.
_EFFECTS = (
    ("run.steps", "lr schedule: the cosine decay ends at run.steps"),
    ("run.time_budget_s", "lr schedule: the cosine decay ends at the time budget"),
    ("train.lr", "lr schedule"),
    ("train.warmup_steps", "lr schedule"),
    ("train.min_lr_ratio", "lr schedule"),
    ("train.betas", "optimizer"),
    ("train.muon_momentum", "optimizer"),
    ("train.weight_decay", "optimizer"),
    ("train.adamw_fused", "numerics (AdamW's fused kernel, the same update to rounding)"),
    ("train.compile_optimizer", "numerics (Muon's step compiled, the same update to rounding)"),
    ("train.compile_head", "numerics (the LM head's cross-entropy compiled, the same loss to rounding)"),
    ("train.grad_clip", "update size"),
    ("train.feature_noise", "features"),
    ("run.seed", "anchors and feature noise (seeded by run.seed)"),
    ("train.num_anchors", "anchors"),
    ("run.deterministic", "numerics (deterministic kernels)"),
    ("drafter.precision", "numerics (float8 matmuls)"),
    ("drafter.fp8_recipe", "numerics (float8 scaling)"),
    ("drafter.jacobi_passes", "decoding only: the Jacobi passes an XPress drafter drafts with"),
    ("data.", "data order and batch shapes; the restored sampler position may no longer match"),
    ("drafter.", "drafter shapes or anchors"),
    ("target.", "target features and shapes"),
    ("loss.", "loss"),
    ("train.", "training step"),
    ("process.", "graph layout"),
    ("channel.", "graph layout"),
)


def _current_layout(config: dict[str, Any], added_later: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A saved config in today's layout: ``drafter.num_anchors`` (the older layout) is
    ``train.num_anchors``, and keys added later (``{table: {key: value before}}``) take the value
    that reproduces the older code, so an unchanged setting is not reported as a change."""
    for table, keys in added_later.items():
        section = config.get(table)
        missing = {k: v for k, v in keys.items() if k not in section} if isinstance(section, dict) else {}
        if missing:
            config = {**config, table: {**section, **missing}}
    drafter = config.get("drafter")
    if not isinstance(drafter, dict) or "num_anchors" not in drafter:
        return config
    drafter = dict(drafter)
    train = {**config.get("train", {}), "num_anchors": drafter.pop("num_anchors")}
    return {**config, "drafter": drafter, "train": train}


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a config dict; arrays of named tables are keyed by name, as ``--set`` is."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and obj and all(isinstance(x, dict) and "name" in x for x in obj):
        out = {}
        for x in obj:
            out.update(_flatten({k: v for k, v in x.items() if k != "name"}, f"{prefix}.{x['name']}"))
        return out
    return {prefix: obj}


def config_changes(old: dict[str, Any], new: dict[str, Any],
                   added_later: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """``"run.steps 8 -> 12 (lr schedule: ...)"`` for every training-relevant key that differs
    between two resolved configs (``msgspec.to_builtins`` of :class:`dflash.run.config.DFlashFile`).
    ``added_later``: ``{table: {key: value before the key existed}}`` (the graph file's marked
    keys, :func:`dflash.run.config.added_later_keys`); a config that lacks one reads as holding it."""
    added_later = added_later or {}
    a, b = _flatten(_current_layout(old, added_later)), _flatten(_current_layout(new, added_later))
    out = []
    for key in sorted(a.keys() | b.keys()):
        if key.startswith(_IGNORED) or a.get(key) == b.get(key):
            continue
        effect = next((e for p, e in _EFFECTS if key.startswith(p)), "training")
        out.append(f"{key} {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r} ({effect})")
    return out


def saved_config(path: Path) -> dict[str, Any] | None:
    """The ``train_config.json`` of a checkpoint, or None (older checkpoints have none)."""
    try:
        return json.loads((Path(path) / TRAIN_CONFIG).read_text())
    except (OSError, ValueError):
        return None


def changes_since(resumed: Resumed, config: dict[str, Any], config_hash: str,
                  added_later: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """What differs between the checkpoint's training config and ``config`` (the resolved graph
    file as plain data, :func:`config_changes` with ``added_later``); only the hashes when the
    checkpoint predates ``train_config.json`` (``config_hash``: :func:`dflash.run.config.config_hash`
    of the new one)."""
    saved = saved_config(resumed.path)
    if saved is not None:
        return config_changes(saved, config, added_later)
    old = resumed.meta.get("config_hash")
    if old not in (None, config_hash):
        return [f"config hash {old} -> {config_hash} (the checkpoint does not record which keys)"]
    return []
