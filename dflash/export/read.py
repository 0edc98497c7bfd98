"""Reading a public-layout drafter directory (ours, or one of z-lab's) back into a
:class:`dflash.model.drafter.DFlashDrafter`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.variants import VARIANTS, by_architecture

__all__ = ["load_exported"]


def load_exported(directory: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """Build a :class:`DFlashDrafter` from a public-layout directory (ours or a z-lab one; any
    variant of :mod:`dflash.model.variants`: DFlash, DFlash2, whose codebooks may be stored bare or
    as ``.weight``, XPress, ...).

    Raises:
        ValueError: ``architectures`` names no variant's architecture (``["DFlashDraftModel"]``,
            ``["DFlash2DraftModel"]``, ...), or a key the variant requires is missing.
        RuntimeError: the weights do not match the config.
    """
    d = Path(directory)
    raw = json.loads((d / "config.json").read_text())
    arch = raw.get("architectures")
    spec = by_architecture(arch[0]) if isinstance(arch, list) and len(arch) == 1 else None
    if spec is None:
        raise ValueError(f"{d}/config.json: architectures {arch} is not one of "
                         f"{[[v.architecture] for v in VARIANTS]}")
    dfc = raw.get("dflash_config", {})
    extra = {}
    for k, ours in spec.export_keys:
        value = dfc.get(k, raw.get(k))  # z-lab's DFlash2 configs have held them at the top level too
        if value is None and spec.export_keys_required:
            raise ValueError(f"{d}/config.json: a {spec.architecture} config needs dflash_config.{k}")
        if value is not None:  # left out and optional: the variant's defaults (speculators', for XPress)
            extra[ours] = int(value)
    rope = raw.get("rope_parameters") or {}
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["full_attention"] * n
    cfg = DrafterConfig(
        num_layers=n,
        block_size=dfc.get("block_size", raw.get("block_size", 16)),
        mask_token_id=dfc.get("mask_token_id"),
        layer_types=types,
        sliding_window=raw.get("sliding_window") if "sliding_attention" in types else None,
        hidden_size=raw["hidden_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
        max_position_embeddings=raw.get("max_position_embeddings"),
        vocab_size=raw.get("vocab_size"),
        target_layer_ids=list(dfc["target_layer_ids"]),
        num_target_layers=raw.get("num_target_layers"),
        variant=spec.name,
        **extra,
    )
    drafter = DFlashDrafter(cfg)
    weights = {_BARE.get(k, k): t for k, t in load_file(str(d / "model.safetensors")).items()}
    drafter.load_state_dict(weights, strict=True)
    drafter.to(device=device, dtype=dtype or torch.float32)
    return drafter.eval(), cfg


# z-lab's save_pretrained writes the codebooks with ".weight" (its nn.Embedding names); ours are bare
_BARE = {f"candidate_selector.{n}_codebook.weight": f"candidate_selector.{n}_codebook"
         for n in ("predecessor", "successor")}
