"""The target's frozen token embedding and LM head, shared by the drafter, and reading them alone.

:func:`dflash.model.target.load_shared_head` builds a :class:`SharedHead` without building the target,
reading only the two matrices from safetensors (:func:`read_safetensors`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dflash.model.build_lock import BUILD_LOCK

__all__ = ["SharedHead", "read_safetensors"]


class SharedHead(nn.Module):
    """The target's frozen token embedding and LM head, shared by the drafter.

    ``embed(ids [..]) -> [.., H]``; ``logits(hidden [.., H]) -> [.., V]`` (``hidden @ W^T``, no
    bias, in the head's dtype; callers pick the positions first, never the whole sequence).
    Not part of the drafter's state_dict; never trained.
    """

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        with BUILD_LOCK:  # never beside a target's build in another thread (dflash.model.build_lock)
            self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
            tied = lm_head_weight is embed_weight
            self.lm_head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False)
            self.lm_head.weight = self.embed_tokens.weight if tied else nn.Parameter(lm_head_weight)
        self.requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))


def read_safetensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read just ``names`` from a local (optionally sharded) safetensors checkpoint."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {n: path / weight_map[n] for n in names if n in weight_map}
    else:
        files = {n: path / "model.safetensors" for n in names}
    out: dict[str, torch.Tensor] = {}
    for name, file in files.items():
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: target.path must hold safetensors weights")
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                out[name] = f.get_tensor(name)
    return out
