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
import os
import shutil
from pathlib import Path

from dflash.errors import ConfigError
from dflash.model.drafter import DrafterConfig
from dflash.run.config import DFlashFile

__all__ = ["check_block_fits", "check_drafter_attention", "check_drafter_replicas", "check_fast_paths",
           "check_model_shapes", "check_monitor_backend", "check_run_dir", "check_trains_something", "checkpoint_bytes",
           "disk_space_warnings", "drafter_replicas", "lr_warnings", "preflight"]

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


TARGET_KIND = "dflash.target"


def check_fast_paths(cfg: DFlashFile) -> None:
    """The fused/quantized paths against the loss, the installed packages and the devices.

    Raises:
        ConfigError: ``train.lm_head = "liger"`` with ``loss.kl_weight``, ``tv_weight`` or
            ``conf_weight`` > 0 (the fused loss is the hard-label CE only), with ``train.sync_free_loss = false`` (it replaces the
            fixed-shape head) or with a CPU drafter; a Liger switch without liger_kernel installed;
            ``target.quantization = "fp8"`` without torchao, or ``fp8``/``varlen`` on a CPU target.
    """
    t, d, tr = cfg.target, cfg.drafter, cfg.train
    if tr.lm_head == "liger":
        soft = [k for k in ("kl_weight", "tv_weight", "conf_weight") if getattr(cfg.loss, k) > 0]
        if soft:
            raise ConfigError(f"train.lm_head = \"liger\" fuses the hard-label cross-entropy only, but "
                              f"loss.{soft[0]} = {getattr(cfg.loss, soft[0]):g}: set it to 0 or "
                              "train.lm_head = \"chunked\"")
        if d.variant == "dflash2":
            raise ConfigError("train.lm_head = \"liger\" gives no top-K candidates for DFlash2's selector: "
                              "set train.lm_head = \"chunked\" with drafter.variant = \"dflash2\"")
        if not tr.sync_free_loss:
            raise ConfigError("train.lm_head = \"liger\" replaces the fixed-shape LM head: set "
                              "train.sync_free_loss = true or train.lm_head = \"chunked\"")
        cpu = [x for x in _devices(cfg, DRAFTER_KIND) if not x.startswith("cuda")]
        if cpu:
            raise ConfigError(f"train.lm_head = \"liger\" runs Triton kernels on CUDA, but process "
                              f"'drafter' runs on {cpu[0]}: set train.lm_head = \"chunked\"")
    if (tr.lm_head == "liger" or d.kernels == "liger") and importlib.util.find_spec("liger_kernel") is None:
        key = "train.lm_head" if tr.lm_head == "liger" else "drafter.kernels"
        raise ConfigError(f"{key} = \"liger\" needs the liger-kernel package (pip install liger-kernel); "
                          f"set {key} = \"{'chunked' if key == 'train.lm_head' else 'torch'}\"")
    if t.quantization == "fp8" and importlib.util.find_spec("torchao") is None:
        raise ConfigError("target.quantization = \"fp8\" needs the torchao package (pip install torchao); "
                          "set target.quantization = \"none\"")
    engine = [f"target.quantization = \"{t.quantization}\""] if t.quantization != "none" else []
    engine += ["target.attn_implementation = \"varlen\""] if t.attn_implementation == "varlen" else []
    cpu = [x for x in _devices(cfg, TARGET_KIND) if not x.startswith("cuda")]
    if engine and cpu:
        raise ConfigError(f"{engine[0]} runs on CUDA only, but process 'target' runs on {cpu[0]}; "
                          "put the target on a cuda:N device or leave the setting at its default")


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


def check_trains_something(cfg: DFlashFile) -> None:
    """A DFlash graph trains in its ``dflash.drafter`` process; a file without one (e.g. cut off
    before its ``[[process]]`` tables) would start, train nothing and report success.

    Raises:
        ConfigError: no process of kind ``dflash.drafter``.
    """
    if not any(p.kind == DRAFTER_KIND for p in cfg.process):
        have = ", ".join(sorted({p.kind for p in cfg.process})) or "no [[process]] tables at all"
        raise ConfigError(f"the graph has no process of kind '{DRAFTER_KIND}' ({have}), so nothing would train: "
                          "add the [[channel]] and [[process]] tables of prefetch -> target -> postprocess -> "
                          "drafter -> monitor (examples/dflash-tiny.toml has them)")


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
    check_trains_something(cfg)
    check_monitor_backend(cfg)
    check_model_shapes(cfg)
    check_block_fits(cfg)
    check_drafter_attention(cfg)
    check_fast_paths(cfg)
    return lr_warnings(cfg)


def _name_max(path: Path) -> int:
    try:
        return os.pathconf(path, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _nearest_existing(path: Path) -> Path:
    """``path`` (absolute) or its nearest parent that exists (a too-long name counts as missing)."""
    p = Path(os.path.abspath(path))
    while p != p.parent:
        try:
            if p.exists():
                return p
        except OSError:  # ENAMETOOLONG
            pass
        p = p.parent
    return p


def check_run_dir(out_dir: str) -> None:
    """``run.out_dir`` and its ``checkpoints/`` exist as directories or can be created, and can be
    written; checked without creating anything (``dflash.run`` calls it before the run lock and
    any data work).

    Raises:
        ConfigError: one line naming the path and the cause: a path component longer than the
            filesystem allows (255 bytes), a file where a directory must be, a read-only
            filesystem, or a directory this user cannot write.
    """
    shown = out_dir if len(out_dir) <= 120 else f"{out_dir[:60]}...{out_dir[-40:]}"
    key = f"run.out_dir = {shown!r}"
    path = Path(out_dir)
    try:
        existing = _nearest_existing(path)
        limit = _name_max(existing if existing.is_dir() else existing.parent)
        for part in path.parts:
            if len(os.fsencode(part)) > limit:
                short = part if len(part) <= 40 else f"{part[:20]}...{part[-12:]}"
                raise ConfigError(f"{key}: the path component {short!r} is {len(os.fsencode(part))} bytes, "
                                  f"over the filesystem's limit of {limit}; choose a shorter run.out_dir")
        for p in (path, path / "checkpoints"):
            if p.exists() and not p.is_dir():
                raise ConfigError(f"{key}: {p} is a file, not a directory; move it away or choose "
                                  "another run.out_dir")
        if not existing.is_dir():
            raise ConfigError(f"{key}: {existing} is a file, not a directory, so {path} cannot be "
                              "created; choose another run.out_dir")
        for p in (existing, path / "checkpoints"):
            if not p.is_dir():
                continue
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                raise ConfigError(f"{key}: {p} is on a read-only filesystem; choose a writable run.out_dir")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}: {p} is not writable by this user; choose another run.out_dir")
    except (OSError, ValueError) as exc:  # a NUL byte, a name the OS refuses: still one line
        raise ConfigError(f"{key} cannot be used: {_one_line(exc)}") from None


def checkpoint_bytes(drafter: DrafterConfig) -> int:
    """Expected size of one checkpoint of a resolved drafter, in bytes: its parameters (``fc``, the
    layers' attention, MLP and norms, the final norms) in fp32, plus AdamW's two fp32 moments."""
    H, n, k = drafter.hidden_size, drafter.num_layers, len(drafter.target_layer_ids)
    q, kv = drafter.num_attention_heads * drafter.head_dim, drafter.num_key_value_heads * drafter.head_dim
    layer = H * q * 2 + H * kv * 2 + 3 * H * drafter.intermediate_size + 2 * drafter.head_dim + 2 * H
    params = k * H * H + n * layer + 2 * H
    return params * 4 * 3


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_space_warnings(out_dir: str, drafter: DrafterConfig, keep_last: int) -> list[str]:
    """A warning when the filesystem of ``run.out_dir`` has less free space than the checkpoints
    a run keeps at once: ``keep_last`` plus the one being written (:func:`checkpoint_bytes` each).
    Never raises."""
    from dflash.checkpoint.files import device_of

    try:
        existing = _nearest_existing(Path(out_dir))
        free = shutil.disk_usage(existing).free
    except (OSError, ValueError):
        return []
    one = checkpoint_bytes(drafter)
    need = one * (keep_last + 1)
    if free >= need:
        return []
    return [(f"run.out_dir = {out_dir!r}: {device_of(existing)} has {_size(free)} free, short of the "
             f"{_size(need)} that {keep_last + 1} checkpoints of about {_size(one)} need (checkpoint.keep_last = "
             f"{keep_last}, plus the one being written); a full disk stops the run (exit 4)")]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
