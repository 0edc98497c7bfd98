"""Drafter weights and configs on disk (the model part of a checkpoint directory).

A drafter directory holds

* ``model.safetensors``: the drafter's state dict under the public DFlash names (no embedding or
  LM head: those are the target's);
* ``drafter_config.json``: the resolved :class:`dflash.model.drafter.DrafterConfig` (msgspec JSON);
* ``target_config.json``: the :class:`dflash.model.target.TargetConfig` the drafter was trained against
  (so eval/export can rebuild the target and its shared head).

:mod:`dflash.checkpoint.format` names these files (and the checkpoint's own, ``meta.json``,
``train_state.pt``, that go next to them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file, save_file

from dflash.checkpoint.format import DRAFTER_CONFIG, TARGET_CONFIG, WEIGHTS
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig

__all__ = ["DRAFTER_CONFIG", "TARGET_CONFIG", "WEIGHTS", "config_files", "load_configs", "locate_target",
           "load_drafter", "save_drafter"]



def config_files(drafter_cfg: DrafterConfig, target_cfg: TargetConfig) -> dict[str, Any]:
    """``{file name: msgspec-encodable object}`` for the two config files."""
    return {DRAFTER_CONFIG: drafter_cfg, TARGET_CONFIG: target_cfg}


def save_drafter(directory: str | Path, drafter: DFlashDrafter, drafter_cfg: DrafterConfig,
                 target_cfg: TargetConfig) -> None:
    """Write weights and both configs into the existing ``directory`` (overwriting them).

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"{d} does not exist; create it first")
    weights = {k: t.detach().contiguous().cpu() for k, t in drafter.state_dict().items()}
    save_file(weights, str(d / WEIGHTS), metadata={"format": "pt"})
    for name, obj in config_files(drafter_cfg, target_cfg).items():
        (d / name).write_bytes(msgspec.json.format(msgspec.json.encode(obj), indent=2))


def load_configs(directory: str | Path) -> tuple[DrafterConfig, TargetConfig]:
    """Read ``drafter_config.json`` and ``target_config.json``. A ``num_anchors`` key in
    ``drafter_config.json`` (checkpoints and exports from when it was a ``[drafter]`` setting)
    is dropped: it is a training-sampling setting, not part of the model.

    Raises:
        FileNotFoundError: a file is missing (the directory is not a drafter checkpoint).
        msgspec.ValidationError: a file does not match the config schema.
    """
    d = Path(directory)
    for name in (DRAFTER_CONFIG, TARGET_CONFIG, WEIGHTS):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d} is not a drafter checkpoint: {name} is missing")
    def read(name: str, kind: type):
        try:
            raw = msgspec.json.decode((d / name).read_bytes())
            if kind is DrafterConfig and isinstance(raw, dict):
                raw.pop("num_anchors", None)  # written before it moved to [train]: older files still load
            return msgspec.convert(raw, kind)
        except (msgspec.MsgspecError, ValueError) as e:  # a damaged or foreign config file
            raise ValueError(f"{d / name} is unreadable ({e}); the checkpoint is damaged: use "
                             "another step") from None

    return read(DRAFTER_CONFIG, DrafterConfig), read(TARGET_CONFIG, TargetConfig)


def locate_target(tc: TargetConfig, directory: str | Path) -> TargetConfig:
    """``tc`` with a relative ``path`` / ``tokenizer`` found from wherever the caller runs.

    A checkpoint records the target's paths as the run resolved them: relative to the directory
    training started in (so a run directory moved together with its models still works). A tool
    run from elsewhere (``cd /tmp && python -m dflash.eval RUN/checkpoints/step_N``) finds them,
    in order: as given (from the current directory); below the nearest ancestor of the checkpoint
    directory that holds them (the run directory usually lives under the directory training
    started in); for the target shipped in this package (``.../dflash/assets/NAME``), in the
    installed package. A path found nowhere is returned unchanged, for the loader's own error.
    """
    assets = Path(__file__).resolve().parents[1] / "assets"

    def find(value: str | None) -> str | None:
        if not value or value.startswith("builtin:") or Path(value).is_absolute() or Path(value).exists():
            return value
        for base in Path(directory).resolve().parents:
            if (base / value).exists():
                return str(base / value)
        shipped = assets / Path(value).name
        if Path(value).parent.name == "assets" and shipped.exists():
            return str(shipped)
        return value

    return msgspec.structs.replace(tc, path=find(tc.path), tokenizer=find(tc.tokenizer))


def load_drafter(directory: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterConfig, TargetConfig]:
    """Rebuild a drafter saved by :func:`save_drafter` (or a dflash checkpoint).

    Returns:
        ``(drafter in eval mode on device/dtype, drafter config, target config)``.

    Raises:
        FileNotFoundError: missing files.
        ValueError: a config or the weights file is unreadable, or the weights do not match the
            config (one line naming the file: the checkpoint is damaged).
    """
    dc, tc = load_configs(directory)
    # float8 is how the weights were trained, not what they are: decoding runs them in bf16/fp32;
    # and eager, since a compiled drafter recompiles at every new context length of a decode
    drafter = DFlashDrafter(msgspec.structs.replace(dc, precision="bf16", compile=False))
    path = Path(directory) / WEIGHTS
    try:
        weights = load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError for a torn or foreign file
        raise ValueError(f"{path} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                         "the checkpoint is damaged: use another step") from None
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match its drafter_config.json "
                         f"({str(e).splitlines()[0]}); the checkpoint is damaged: use another step") from None
    drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device)
    return drafter.eval(), dc, tc
