"""DFlash drafter as a transformers model, for ``trust_remote_code`` loading of an exported drafter.

``python -m dflash.export`` copies this file into the export directory and points ``auto_map`` at
it, so a transformers user needs no other package::

    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)
    out = drafter(target_hidden=feats, noise_embedding=block_emb).last_hidden_state

It imports only torch and transformers (never ``dflash``), and computes what
``dflash.model.drafter.DFlashDrafter`` computes for one block after a context (tested in
``tests/test_export.py`` against :func:`dflash.export.load_exported`). Parameter names are the
public DFlash ones: ``fc``, ``hidden_norm``, ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``,
``layers.N.{input,post_attention}_layernorm``, ``norm``. The drafter shares the target's token
embedding and LM head, which are not part of it: embed the block with the target's embedding and
apply the target's LM head to the output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_outputs import BaseModelOutput


class DFlashRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in fp32, cast back (as Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block, keys/values from ``cat(context, block)``."""

    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        H, nh, nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        d = getattr(c, "head_dim", None) or H // nh
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = DFlashRMSNorm(d, c.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask) -> torch.Tensor:
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, -1, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, -1, self.nkv, self.d).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_k)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.d))
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.d))


class DFlashMLP(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(c)
        self.mlp = DFlashMLP(c)
        self.input_layernorm = DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rope_theta(c: Qwen3Config) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10_000.0)))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (no embedding, no LM head: both are the target's).

    ``config.dflash_config`` holds ``block_size``, ``mask_token_id`` and ``target_layer_ids``.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash_draft"  # no attribute of that name: the checkpoint keys are used as they are
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        H = config.hidden_size
        k = len(config.dflash_config["target_layer_ids"])
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.block_size = int(config.dflash_config["block_size"])
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, t) for t in types)
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, self.config.initializer_range)
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def _rope_table(self, positions: torch.Tensor):
        d = self.layers[0].self_attn.d
        inv_freq = (1.0 / _rope_theta(self.config) ** (torch.arange(0, d, 2, device=positions.device).double()
                                                       / d)).float()
        ang = positions.float()[..., None] * inv_freq
        ang = torch.cat([ang, ang], dim=-1)[:, None]
        return ang.cos(), ang.sin()

    def default_mask(self, T: int, Q: int, positions: torch.Tensor, layer_type: str) -> torch.Tensor:
        """Bool ``[B, 1, Q, T+Q]``: one block after ``T`` context tokens sees all of them (within the
        sliding window for sliding layers) and its own tokens (causally for sliding layers)."""
        qpos, kpos = positions[:, T:], positions
        kv = torch.arange(T + Q, device=positions.device)
        q = torch.arange(Q, device=positions.device)
        mask = torch.ones(positions.shape[0], Q, T + Q, dtype=torch.bool, device=positions.device)
        if layer_type == "sliding_attention":
            window = self.config.sliding_window
            mask &= (qpos[:, :, None] - kpos[:, None, :]) < window
            mask[:, :, T:] &= (kv[None, None, T:] - T) <= q[None, :, None]
        return mask[:, None]

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                return_dict: bool | None = None, **kwargs) -> BaseModelOutput:
        """Draft hidden states for one block per row.

        Args:
            target_hidden: ``[B, T, k*H]`` the target's hidden states of the context tokens at
                ``dflash_config.target_layer_ids``, concatenated on the last dim.
            noise_embedding: ``[B, Q, H]`` the target's embeddings of the block tokens
                ``[anchor, mask, ..., mask]`` (``Q = block_size``).
            position_ids: ``[B, T+Q]`` RoPE positions of the context then the block tokens
                (default ``0..T+Q-1``: the anchor right after the context).
            attention_mask: bool ``[B, 1, Q, T+Q]`` (True = attend), or None for
                :meth:`default_mask` (the same mask for every layer when given).

        Returns:
            ``last_hidden_state [B, Q, H]`` (post-norm); slot ``j`` predicts token ``anchor + j``
            through the target's LM head.
        """
        B, T, _ = target_hidden.shape
        Q = noise_embedding.shape[1]
        dtype = self.fc.weight.dtype
        if position_ids is None:
            position_ids = torch.arange(T + Q, device=target_hidden.device)[None].expand(B, -1)
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x = noise_embedding.to(dtype)
        rope_q = self._rope_table(position_ids[:, T:])
        rope_k = self._rope_table(position_ids)
        masks: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            if attention_mask is not None:
                mask = attention_mask.bool()
            else:
                if layer.layer_type not in masks:
                    masks[layer.layer_type] = self.default_mask(T, Q, position_ids, layer.layer_type)
                mask = masks[layer.layer_type]
            x = layer(x, ctx, rope_q, rope_k, mask)
        return BaseModelOutput(last_hidden_state=self.norm(x))


__all__ = ["DFlashDraftModel"]
