"""Checks across the tables of a DFlash graph file, made before any data work.

Each table validates itself when the file is decoded (msgspec types, ``__post_init__``), but some
mistakes are only visible when tables meet: the drafter against the target's depth and width, the
drafter's attention against the device its process runs on, a ``[monitor]`` backend against what
is installed, data-parallel drafter replicas against the launcher. Each check reads the config
alone (the target's transformers config is read, never its weights); :func:`dflash.run.resolve.resolve`
runs them, so ``python -m dflash.run`` reports them as one line with exit code 2 before it reads
data or writes anything.
"""

from __future__ import annotations

import importlib.util

from dflash.errors import ConfigError
from dflash.model.drafter import DrafterConfig
from dflash.run.config import DFlashFile

__all__ = ["check_block_fits", "check_drafter_attention", "check_drafter_replicas", "check_model_shapes",
           "check_monitor_backend", "drafter_replicas", "lr_warnings", "preflight"]

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
        ConfigError: wandb is not installed and a monitor process would start it.
    """
    mode = cfg.monitor.wandb
    if mode == "disabled" or not any(p.kind == MONITOR_KIND for p in cfg.process):
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"monitor.wandb = {mode!r} needs the wandb package, which is not installed; set "
            "monitor.wandb = \"disabled\" (--set monitor.wandb=disabled) or pip install wandb")


def check_model_shapes(cfg: DFlashFile) -> DrafterConfig:
    """The target config (overrides included), its layer choice, and the drafter resolved
    against it (:func:`dflash.model.drafter.resolve_drafter_config`, checked).

    Returns:
        the resolved drafter config (every dimension set, ``target_layer_ids`` chosen).

    Raises:
        ConfigError: unreadable ``target.path`` config, an unknown ``target.overrides`` key,
            ``target.layer_ids`` out of range or naming the last layer, a target too shallow for ``drafter.num_layers``
            default layers, a ``drafter.hidden_size`` unlike the target's, or drafter heads that
            do not divide.
    """
    from dflash.model.layer_ids import check_not_last_layer
    from dflash.model.target import build_hf_config, resolve_layer_ids

    try:
        hf = build_hf_config(cfg.target)
    except (OSError, ValueError) as exc:  # FileNotFoundError, bad overrides, unreadable config.json
        raise ConfigError(_one_line(exc)) from None
    try:
        layer_ids = resolve_layer_ids(cfg.target, hf, cfg.drafter.num_layers)
        check_not_last_layer(layer_ids, hf.num_hidden_layers)
        drafter = cfg.drafter.resolve(hf, layer_ids)
        drafter.check_resolved()
    except ValueError as exc:
        raise ConfigError(_one_line(exc)) from None
    return drafter


def check_block_fits(cfg: DFlashFile) -> None:
    """A conversation is kept only with at least ``2 * drafter.block_size`` loss tokens within
    ``data.max_length`` tokens (:mod:`dflash.data.chat`), so a larger block leaves no data.

    Raises:
        ConfigError: ``2 * drafter.block_size > data.max_length``.
    """
    bs, max_len = cfg.drafter.block_size, cfg.data.max_length
    if 2 * bs > max_len:
        raise ConfigError(
            f"drafter.block_size = {bs} leaves no usable conversation: each needs at least 2 x {bs} "
            f"loss tokens, more than data.max_length = {max_len} tokens can hold; lower "
            f"drafter.block_size (16 is the DFlash default) or raise data.max_length to >= {2 * bs}")


def check_drafter_attention(cfg: DFlashFile) -> None:
    """``drafter.attn_implementation = "flex_attention"`` trains only on CUDA.

    Raises:
        ConfigError: a drafter replica runs on the CPU (FlexAttention has no CPU backward).
    """
    if cfg.drafter.attn_implementation != "flex_attention":
        return
    cpu = [d for d in _devices(cfg, DRAFTER_KIND) if not d.startswith("cuda")]
    if cpu:
        raise ConfigError(
            f"drafter.attn_implementation = \"flex_attention\" needs a CUDA drafter, but process "
            f"'drafter' runs on {cpu[0]} (PyTorch's FlexAttention has no backward on CPU); set "
            "drafter.attn_implementation = \"sdpa\" or put the drafter on a cuda:N device")


def drafter_replicas(cfg: DFlashFile) -> int:
    """Replicas of the ``dflash.drafter`` process (data-parallel drafters; 1 when there is none)."""
    return next((p.replicas for p in cfg.process if p.kind == DRAFTER_KIND), 1)


def check_drafter_replicas(cfg: DFlashFile, *, launched: bool) -> None:
    """Data-parallel drafters (``replicas > 1``) need one torchrun rank each.

    Raises:
        ConfigError: more than one drafter replica and ``launched`` is False (not under torchrun).
    """
    drafters = drafter_replicas(cfg)
    if drafters > 1 and not launched:
        raise ConfigError(
            f"process 'drafter' has replicas = {drafters}: data-parallel drafters need one rank each; "
            f"launch with torchrun --nproc-per-node {drafters} -m dflash.run ... (docs/distributed.md)")


def lr_warnings(cfg: DFlashFile) -> list[str]:
    """A learning rate that decodes (finite, float32-safe) but no AdamW run survives."""
    lr = cfg.train.lr
    if lr > 1.0:
        return [f"train.lr = {lr:g} is above 1, far beyond a usable AdamW learning rate (6e-4 is "
                "typical); expect the weights to blow up and steps to be skipped"]
    return []


def preflight(cfg: DFlashFile) -> list[str]:
    """The checks of one graph file that need no tokenizer and no launcher, in the order a user
    would fix them (:func:`dflash.run.resolve.resolve` runs them all, on the filled file).

    Returns:
        Warnings (one line each) for settings that are legal but almost certainly unintended.

    Raises:
        ConfigError: the first problem, one line naming the key to change.
    """
    check_monitor_backend(cfg)
    check_model_shapes(cfg)
    check_block_fits(cfg)
    check_drafter_attention(cfg)
    return lr_warnings(cfg)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
