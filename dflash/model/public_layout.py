"""A public-layout drafter directory read back: ``config.json`` as a :class:`DrafterConfig` and
``model.safetensors`` under this project's parameter names.

The layout is the one :mod:`dflash.export` writes and z-lab's DFlash/DFlash2 drafters ship
(``architectures = ["DFlashDraftModel"]``, ``["DFlash2DraftModel"]``, ...: a variant's entry in
:mod:`dflash.model.variants`). It is read here, below the checkpoint and the run, so a run can
check and load such a directory as its starting weights (``[train].init_from``,
:mod:`dflash.checkpoint.init_from`) and :func:`dflash.export.load_exported` rebuilds a drafter from
the same two readers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash.model.drafter_config import DrafterConfig
from dflash.model.variants import VARIANTS, by_architecture

__all__ = ["CONFIG", "WEIGHTS", "exported_config", "exported_shapes", "exported_state_dict", "is_public_layout"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"

# z-lab's save_pretrained writes the codebooks with ".weight" (its nn.Embedding names); ours are bare
_BARE = {f"candidate_selector.{n}_codebook.weight": f"candidate_selector.{n}_codebook"
         for n in ("predecessor", "successor")}


def is_public_layout(directory: str | Path) -> bool:
    """Whether ``directory`` holds ``config.json`` and ``model.safetensors`` (what the layout
    needs; whether the config names a drafter is :func:`exported_config`'s to say)."""
    d = Path(directory)
    return (d / CONFIG).is_file() and (d / WEIGHTS).is_file()


def exported_config(directory: str | Path) -> DrafterConfig:
    """The drafter ``directory/config.json`` describes (ours or a z-lab one; any variant of
    :mod:`dflash.model.variants`). Reads that one file; builds nothing.

    Raises:
        FileNotFoundError: there is no ``config.json``.
        ValueError: it is not a JSON object; its ``architectures`` names no variant's
            architecture (``["DFlashDraftModel"]``, ``["DFlash2DraftModel"]``, ...), or a key the
            drafter needs (``num_hidden_layers``, ``dflash_config.target_layer_ids``, one the
            variant requires) is missing.
    """
    d = Path(directory)
    path = d / CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")  # noqa: TRY004 - a file's content, not an argument
    arch = raw.get("architectures")
    spec = by_architecture(arch[0]) if isinstance(arch, list) and len(arch) == 1 else None
    if spec is None:
        raise ValueError(f"{path}: architectures {arch} is not one of "
                         f"{[[v.architecture] for v in VARIANTS]}")
    dfc = raw.get("dflash_config", {})
    extra = {}
    for k, ours in spec.export_keys:
        value = dfc.get(k, raw.get(k))  # z-lab's DFlash2 configs have held them at the top level too
        if value is None and spec.export_keys_required:
            raise ValueError(f"{path}: a {spec.architecture} config needs dflash_config.{k}")
        if value is not None:  # left out and optional: the variant's defaults (speculators', for XPress)
            extra[ours] = int(value)
    try:
        rope = raw.get("rope_parameters") or {}
        n = raw["num_hidden_layers"]
        types = raw.get("layer_types") or ["full_attention"] * n
        return DrafterConfig(
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
    except KeyError as e:
        where = "dflash_config." if e.args and e.args[0] == "target_layer_ids" else ""
        raise ValueError(f"{path}: a {spec.architecture} config needs {where}{e.args[0]}") from None


def exported_state_dict(directory: str | Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``directory/model.safetensors`` under this project's names (z-lab's ``.weight``-suffixed
    DFlash2 codebooks renamed to the bare ones), as stored (dtype unchanged).

    Raises:
        FileNotFoundError: there is no ``model.safetensors``.
        ValueError: the file is unreadable (torn, or not safetensors).
    """
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        weights = load_file(str(path), device=str(device))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError for a torn or foreign file
        raise ValueError(f"{path} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return {_BARE.get(k, k): t for k, t in weights.items()}


def exported_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of ``directory/model.safetensors`` under this project's names, read from
    the file's header alone (no tensor is loaded).

    Raises:
        FileNotFoundError: there is no ``model.safetensors``.
        ValueError: the file is unreadable.
    """
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {_BARE.get(k, k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: an unusable file
        raise ValueError(f"{path} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
