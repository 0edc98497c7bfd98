"""Checks across the tables of a DFlash graph file, made before any data work.

Each table validates itself when the file is decoded (msgspec types, ``__post_init__``), but some
mistakes are only visible when tables meet: the drafter against the target's depth and width, the
drafter's attention against the device its process runs on, a ``[monitor]`` backend against what
is installed. :func:`preflight` makes those checks from the config alone (the target's
transformers config is read, never its weights), so ``python -m dflash.run`` reports them as one
line with exit code 2 before it tokenizes, loads or writes anything.
"""

from __future__ import annotations

import importlib.util

import csp
from dflash.config import DFlashFile

__all__ = ["preflight"]

DRAFTER_KIND = "dflash.drafter"
MONITOR_KIND = "dflash.monitor"


def _devices(cfg: DFlashFile, kind: str) -> list[str]:
    """Devices the replicas of every ``kind`` process run on ("cpu" where the graph gives none)."""
    out: list[str] = []
    for p in cfg.process:
        if p.kind == kind:
            devs = p.devices if p.devices is not None else [p.device] * p.replicas
            out += [d or "cpu" for d in devs]
    return out


def check_monitor_backend(cfg: DFlashFile) -> None:
    """``[monitor].wandb`` other than "disabled" needs an importable ``wandb``.

    Raises:
        csp.GraphError: wandb is not installed and a monitor process would start it.
    """
    mode = cfg.monitor.wandb
    if mode == "disabled" or not any(p.kind == MONITOR_KIND for p in cfg.process):
        return
    if importlib.util.find_spec("wandb") is None:
        raise csp.GraphError(
            f"monitor.wandb = {mode!r} needs the wandb package, which is not installed; set "
            "monitor.wandb = \"disabled\" (--set monitor.wandb=disabled) or pip install wandb")


def check_model_shapes(cfg: DFlashFile) -> None:
    """The target config (overrides included), its layer choice, and the drafter resolved
    against it: what :func:`dflash.drafter.resolve_drafter_config` will do once the data is loaded.

    Raises:
        csp.GraphError: unreadable ``target.path`` config, an unknown ``target.overrides`` key,
            ``target.layer_ids`` out of range, a target too shallow for ``drafter.num_layers``
            default layers, a ``drafter.hidden_size`` unlike the target's, or drafter heads that
            do not divide.
    """
    from dflash.target import build_hf_config, resolve_layer_ids

    try:
        hf = build_hf_config(cfg.target)
    except (OSError, ValueError) as exc:  # FileNotFoundError, bad overrides, unreadable config.json
        raise csp.GraphError(_one_line(exc)) from None
    try:
        layer_ids = resolve_layer_ids(cfg.target, hf, cfg.drafter.num_layers)
        cfg.drafter.resolve(hf, layer_ids).check_resolved()
    except ValueError as exc:
        raise csp.GraphError(_one_line(exc)) from None


def check_drafter_attention(cfg: DFlashFile) -> None:
    """``drafter.attn_implementation = "flex_attention"`` trains only on CUDA.

    Raises:
        csp.GraphError: a drafter replica runs on the CPU (FlexAttention has no CPU backward).
    """
    if cfg.drafter.attn_implementation != "flex_attention":
        return
    cpu = [d for d in _devices(cfg, DRAFTER_KIND) if not d.startswith("cuda")]
    if cpu:
        raise csp.GraphError(
            f"drafter.attn_implementation = \"flex_attention\" needs a CUDA drafter, but process "
            f"'drafter' runs on {cpu[0]} (PyTorch's FlexAttention has no backward on CPU); set "
            "drafter.attn_implementation = \"sdpa\" or put the drafter on a cuda:N device")


def lr_warnings(cfg: DFlashFile) -> list[str]:
    """A learning rate that decodes (finite, float32-safe) but no AdamW run survives."""
    lr = cfg.train.lr
    if lr > 1.0:
        return [f"train.lr = {lr:g} is above 1, far beyond a usable AdamW learning rate (6e-4 is "
                "typical); expect the weights to blow up and steps to be skipped"]
    return []


def preflight(cfg: DFlashFile) -> list[str]:
    """Every cross-table check, in the order a user would fix them.

    Returns:
        Warnings (one line each) for settings that are legal but almost certainly unintended.

    Raises:
        csp.GraphError: the first problem, one line naming the key to change.
    """
    check_monitor_backend(cfg)
    check_model_shapes(cfg)
    check_drafter_attention(cfg)
    return lr_warnings(cfg)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
