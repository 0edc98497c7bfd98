"""Reading a public-layout drafter directory (ours, or one of z-lab's) back into a
:class:`dflash.model.drafter.DFlashDrafter`: its ``config.json`` and weights are read by
:mod:`dflash.model.public_layout` (where a run's ``[train].init_from`` reads them too)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.public_layout import exported_config, exported_state_dict

__all__ = ["exported_config", "load_exported"]


def load_exported(directory: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """Build a :class:`DFlashDrafter` from a public-layout directory (ours or a z-lab one; any
    variant of :mod:`dflash.model.variants`: DFlash, DFlash2, whose codebooks may be stored bare or
    as ``.weight``, XPress, ...). The config is :func:`exported_config`'s reading of ``config.json``.

    Raises:
        FileNotFoundError: ``config.json`` or ``model.safetensors`` is missing.
        ValueError: ``architectures`` names no variant's architecture (``["DFlashDraftModel"]``,
            ``["DFlash2DraftModel"]``, ...), a key the variant requires is missing, or a file is
            unreadable.
        RuntimeError: the weights do not match the config.
    """
    cfg = exported_config(directory)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(exported_state_dict(directory), strict=True)
    drafter.to(device=device, dtype=dtype or torch.float32)
    return drafter.eval(), cfg
