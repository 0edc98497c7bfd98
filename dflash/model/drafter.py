"""The DFlash block-diffusion drafter (Qwen3-style layers), with the public parameter names.

Architecture (DFlash, "Block Diffusion for Flash Speculative Decoding", z-lab; public
``DFlashDraftModel``):

* ``ctx = hidden_norm(fc(features))``: the ``k`` captured target layers ``[.., k*H]`` projected to
  ``H`` and RMS-normalised; computed once, shared by every drafter layer.
* ``num_layers`` decoder layers: ``x += o_proj(attn(input_layernorm(x)))``,
  ``x += mlp(post_attention_layernorm(x))`` with SwiGLU ``down(silu(gate(x)) * up(x))``.
  Attention: queries from the block tokens only; keys/values from ``cat(ctx, block)`` through the
  same ``k_proj``/``v_proj``; per-head RMSNorm on q and k (QK-norm) before RoPE; GQA.
* ``norm`` on the output; the target's frozen LM head (not part of this module) makes logits.

The block's input is the shared embedding of ``[anchor token, mask, mask, ...]``; output slot
``j`` predicts the token at ``anchor + j`` (slot 0 is the known anchor and is not scored).

State-dict keys are exactly the public ones: ``fc.weight``, ``hidden_norm.weight``,
``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.self_attn.{q,k}_norm.weight``,
``layers.N.input_layernorm.weight``, ``layers.N.post_attention_layernorm.weight``,
``layers.N.mlp.{gate,up,down}_proj.weight``, ``norm.weight``. ``[drafter].confidence_head`` adds
DSpark's confidence head (:mod:`dflash.model.confidence_head`) as ``confidence_head.proj.{weight,bias}``,
which the export leaves out.
"""

from __future__ import annotations

import math
import warnings
from typing import Annotated, Literal

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from csp._guard import check as _check_owner
from dflash.model.attention import BlockLayout, flex_block_mask, sdpa_mask
from dflash.model.confidence_head import ConfidenceHead
from dflash.model.target_config import TargetConfig
from dflash.model.dflash2 import CandidateSelector, GroupedDynamicCausalConv

_check_owner("dflash", __file__.rsplit("/", 2)[0])  # eval/export under another 'dflash' (csp._guard)

__all__ = ["DFLASH2_FIELDS", "DFlashDrafter", "DrafterConfig", "RMSNorm", "resolve_drafter_config",
           "rope_theta_of"]

LayerType = Literal["full_attention", "sliding_attention"]
Positive = Annotated[int, msgspec.Meta(ge=1)]
DFLASH2_FIELDS = ("variant", "conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")
"""The ``[drafter]`` fields DFlash2 added; a DFlash drafter's model does not depend on them."""


class DrafterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The graph file's ``[drafter]`` table; dims left None are filled by :meth:`resolve`.

    Attributes:
        num_layers: drafter decoder layers (also the default number of captured target layers).
        block_size: tokens per block, anchor included (``bs``; bs-1 predictions per block).
        mask_token_id: id of the mask token fed at block slots 1..bs-1 (None = from tokenizer).
        layer_types: per layer "full_attention" | "sliding_attention" (None = all full).
        sliding_window: window in tokens for sliding layers (required if any layer slides).
        attn_implementation: "sdpa" (bool mask) | "flex_attention" (BlockMask; compiled on CUDA).
        hidden_size .. vocab_size: copied from the target config by :meth:`resolve` when None
            (``hidden_size`` must equal the target's: the embedding is shared).
        target_layer_ids: captured target layers (set by :meth:`resolve`).
        num_target_layers: depth of the target (recorded for export).
        kernels: "torch" (the ops below) | "liger": Liger-Kernel's fused RMSNorm and SwiGLU
            (Triton, CUDA only; :mod:`dflash.model.drafter_kernels`). Same parameters and
            state-dict keys; equal loss and gradients to bf16 rounding (tested on the GPU).
        compile: ``torch.compile`` each decoder layer in place (same state-dict keys).
        variant: "dflash" (the DFlash drafter) | "dflash2" (z-lab's DFlash2: adds a grouped
            dynamic causal convolution around every sublayer and a candidate selector,
            :mod:`dflash.model.dflash2`). The four fields below are read by "dflash2" only; their
            defaults are the published checkpoints' values.
        conv_kernel_size: convolution taps (in block tokens, the current one included).
        conv_group_size: channels sharing one dynamic tap (``hidden_size`` must be a multiple).
        selector_top_k: candidates per block position the selector re-ranks.
        selector_rank: rank of the selector's predecessor/successor codebooks.
        confidence_head: add DSpark's confidence head (:mod:`dflash.model.confidence_head`),
            trained by ``[loss].confidence = "head"``. The run sets it from that key; setting it
            here by hand without it is a config error. Checkpointed, not exported.
    """

    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None
    layer_types: list[LayerType] | None = None
    sliding_window: int | None = None
    attn_implementation: Literal["sdpa", "flex_attention"] = "sdpa"
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    kernels: Literal["torch", "liger"] = "torch"
    compile: bool = False
    variant: Literal["dflash", "dflash2"] = "dflash"
    conv_kernel_size: Positive = 2
    conv_group_size: Positive = 16
    selector_top_k: Positive = 16
    selector_rank: Positive = 256
    confidence_head: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"drafter.layer_types has {len(self.layer_types)} entries; "
                             f"num_layers is {self.num_layers}")
        if "sliding_attention" in self.types:
            if self.sliding_window is None or self.sliding_window < self.block_size:
                raise ValueError("drafter.sliding_window must be set and >= block_size when a "
                                 "layer is 'sliding_attention'")
        if self.variant == "dflash2" and self.conv_kernel_size > self.block_size:
            raise ValueError(f"drafter.conv_kernel_size = {self.conv_kernel_size} is longer than a block "
                             f"(block_size = {self.block_size}): the convolution restarts at every block, so "
                             "taps past its start only see zeros; use at most block_size (published: 2)")

    @property
    def types(self) -> list[str]:
        return list(self.layer_types) if self.layer_types else ["full_attention"] * self.num_layers

    def resolve(self, target_hf_config, layer_ids: list[int]) -> "DrafterConfig":
        """A copy with every None dim taken from the target config and ``target_layer_ids`` set.

        Raises:
            ValueError: ``hidden_size`` or ``vocab_size`` differs from the target's (the embedding
                and LM head are shared); ``mask_token_id`` is outside the target's vocabulary;
                ``target_layer_ids`` or ``num_target_layers`` is set and disagrees with the
                target (they are derived: ``[target].layer_ids`` chooses the layers).
        """
        hf = target_hf_config
        H, V, L = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
        if self.hidden_size is not None and self.hidden_size != H:
            raise ValueError(f"drafter.hidden_size = {self.hidden_size} must equal the target's "
                             f"hidden size {H} (the embedding and LM head are shared)")
        if self.vocab_size is not None and self.vocab_size != V:
            raise ValueError(f"drafter.vocab_size = {self.vocab_size} must equal the target's "
                             f"vocabulary size {V} (the embedding and LM head are shared); leave it unset")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < V:
            raise ValueError(f"drafter.mask_token_id = {self.mask_token_id} is outside the target's "
                             f"vocabulary (0..{V - 1}); set it to an unused token id of the tokenizer")
        if self.target_layer_ids is not None and list(self.target_layer_ids) != list(layer_ids):
            raise ValueError(f"drafter.target_layer_ids = {list(self.target_layer_ids)} is derived, not "
                             f"read (the layers chosen here are {list(layer_ids)}): set target.layer_ids = "
                             f"{list(self.target_layer_ids)} instead and leave drafter.target_layer_ids unset")
        if self.num_target_layers is not None and self.num_target_layers != L:
            raise ValueError(f"drafter.num_target_layers = {self.num_target_layers} is derived from the "
                             f"target, which has {L} layers; leave it unset")
        heads = self.num_attention_heads or hf.num_attention_heads
        fill = {
            "hidden_size": H,
            "num_attention_heads": heads,
            "num_key_value_heads": self.num_key_value_heads or getattr(hf, "num_key_value_heads", heads),
            "head_dim": self.head_dim or getattr(hf, "head_dim", None) or H // heads,
            "intermediate_size": self.intermediate_size or hf.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps or getattr(hf, "rms_norm_eps", 1e-6),
            "rope_theta": self.rope_theta or rope_theta_of(hf),
            "max_position_embeddings": self.max_position_embeddings or hf.max_position_embeddings,
            "vocab_size": self.vocab_size or hf.vocab_size,
            "target_layer_ids": list(layer_ids),
            "num_target_layers": hf.num_hidden_layers,
        }
        return msgspec.structs.replace(self, **fill)

    def check_resolved(self) -> None:
        """Raise ValueError naming the first dim still None (call :meth:`resolve` first)."""
        for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "rms_norm_eps", "rope_theta", "target_layer_ids"):
            if getattr(self, f) is None:
                raise ValueError(f"drafter.{f} is unset; call DrafterConfig.resolve(target config)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("drafter.num_attention_heads must be a multiple of num_key_value_heads")
        if self.variant == "dflash2":
            if self.hidden_size % self.conv_group_size:
                raise ValueError(f"drafter.conv_group_size = {self.conv_group_size} does not divide the "
                                 f"hidden size {self.hidden_size} (the target's); use a divisor of it "
                                 "(published: 16)")
            if self.vocab_size is not None and self.selector_top_k > self.vocab_size:
                raise ValueError(f"drafter.selector_top_k = {self.selector_top_k} exceeds the vocabulary "
                                 f"({self.vocab_size} tokens); published: 16")


def resolve_drafter_config(cfg: DrafterConfig, target_cfg: TargetConfig) -> DrafterConfig:
    """:meth:`DrafterConfig.resolve` against the target described by ``target_cfg``
    (a :class:`dflash.model.target.TargetConfig`), without building the target."""
    from dflash.model.target import build_hf_config, resolve_layer_ids

    hf = build_hf_config(target_cfg)
    return cfg.resolve(hf, resolve_layer_ids(target_cfg, hf, cfg.num_layers))


def rope_theta_of(hf_config) -> float:
    """RoPE base of a transformers config (``rope_parameters`` in 5.x, ``rope_theta`` before).

    Raises:
        ValueError: a scaled RoPE (yarn, llama3, ...): the drafter implements the default only.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"target rope_type {kind!r} is not supported by the drafter (default only)")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10_000.0)))


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 (as Qwen3RMSNorm), cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x [B, h, N, d]``, ``cos/sin [B, 1, N, d]`` (fp32, cast to x's dtype)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale):
    """flex_attention, compiled on CUDA; eager (unfused, for tests/equivalence) elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    with warnings.catch_warnings():  # "called without torch.compile": intended off-CUDA
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        H, nh, nkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        self.k_norm = RMSNorm(d, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask) -> torch.Tensor:
        """``x [B, Q, H]`` block tokens, ``ctx [B, T, H]``; mask: bool [B,1,Q,T+Q] or BlockMask."""
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)                                   # [B, T+Q, H]
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, -1, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, -1, self.nkv, self.d).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_k)
        scale = 1.0 / math.sqrt(self.d)
        if isinstance(mask, torch.Tensor):
            rep = self.nh // self.nkv  # explicit GQA repeat keeps SDPA on its fused masked kernels
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            out = _flex_attention(q, k, v, mask, scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.block = c.block_size
        if c.variant == "dflash2":  # around each sublayer (dflash.model.dflash2)
            self.attention_conv = GroupedDynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, ctx, rope_q, rope_k, mask) -> torch.Tensor:
        if self.attention_conv is not None:
            return self._forward_conv(x, ctx, rope_q, rope_k, mask)
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _forward_conv(self, x, ctx, rope_q, rope_k, mask) -> torch.Tensor:
        return self.apply_conv(x, lambda h: self.self_attn(h, ctx, rope_q, rope_k, mask))

    def apply_conv(self, x: torch.Tensor, attend) -> torch.Tensor:
        """DFlash2's layer: ``x += conv_1(f(conv_0(u)))`` with ``u`` the normed input, both sides'
        taps from ``u`` (``x [B, Q, H]``, ``Q`` a multiple of the block size: blocks never mix).
        ``attend(h [B, Q, H]) -> [B, Q, H]`` is the attention sublayer (a KV-cached decode passes
        its own, :class:`dflash.eval.selector.CachedSelectorProposer`)."""
        u = self.input_layernorm(x)
        c = self.attention_conv.coefficients(u)                              # [B, Q, 2, K, G]
        x = x + self.attention_conv(attend(self.attention_conv(u, c, 0, self.block)), c, 1, self.block)
        u = self.post_attention_layernorm(x)
        c = self.mlp_conv.coefficients(u)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(u, c, 0, self.block)), c, 1, self.block)


class DFlashDrafter(nn.Module):
    """The drafter. Build from a resolved :class:`DrafterConfig` (see :meth:`DrafterConfig.resolve`).

    Args:
        cfg: resolved config.
        seed: weight-init seed (``N(0, 0.02)`` matrices, unit norms); None = global RNG.
    """

    def __init__(self, cfg: DrafterConfig, seed: int | None = None) -> None:
        super().__init__()
        cfg.check_resolved()
        self.cfg = cfg
        H, k = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.types)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if cfg.variant == "dflash2":
            self.candidate_selector = CandidateSelector(cfg.vocab_size, H, cfg.selector_rank, cfg.selector_top_k)
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(H)
        # fp32 RoPE frequencies kept outside the module's buffers, so .to(bf16) cannot round them
        self._inv_freq = (1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).double()
                                                  / cfg.head_dim)).float()
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # copies per device, made once
        self.reset_parameters(seed)
        if cfg.kernels != "torch" or cfg.compile:  # fused kernels / compiled layers, same weights
            from dflash.model.drafter_kernels import apply_kernels

            apply_kernels(self, cfg.kernels, cfg.compile, RMSNorm, MLP)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Backbone: ``N(0, 0.02)`` matrices, unit norms. DFlash2's modules and the confidence head
        are skipped in that loop and initialised after it (:mod:`dflash.model.dflash2`,
        :mod:`dflash.model.confidence_head`), so the backbone's draws, and with them a fresh
        drafter's hidden states, equal the plain DFlash drafter's of the same seed."""
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed) if seed is not None else None
        added = {id(p) for m in self.modules()
                 if isinstance(m, (GroupedDynamicCausalConv, CandidateSelector, ConfidenceHead))
                 for p in m.parameters()}
        for name, p in self.named_parameters():
            if id(p) in added:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for m in self.modules():
            if isinstance(m, GroupedDynamicCausalConv):
                m.reset_parameters()
            elif isinstance(m, CandidateSelector):
                m.reset_parameters(gen)
        if isinstance(getattr(self, "confidence_head", None), ConfidenceHead):
            self.confidence_head.reset_parameters(gen)

    def _rope_table(self, positions: torch.Tensor):
        """``cos, sin [B, 1, N, head_dim]`` fp32 for ``positions [B, N]``."""
        # A host -> device copy of pageable memory waits for the device: make it once per device.
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self._inv_freq.to(positions.device)
        ang = positions.float()[..., None] * inv_freq                       # [B, N, d/2]
        ang = torch.cat([ang, ang], dim=-1)[:, None]
        return ang.cos(), ang.sin()

    def build_masks(self, layout: BlockLayout) -> dict[str, object]:
        """One mask per distinct layer type (bool tensor or BlockMask per ``attn_implementation``)."""
        make = flex_block_mask if self.cfg.attn_implementation == "flex_attention" else sdpa_mask
        masks: dict[str, object] = {}
        for t in set(self.cfg.types):
            sliding = t == "sliding_attention"
            masks[t] = make(layout, causal_block=sliding,
                            window=self.cfg.sliding_window if sliding else None)
        return masks

    def forward(self, features: torch.Tensor, block_emb: torch.Tensor, layout: BlockLayout,
                masks: dict[str, object] | None = None) -> torch.Tensor:
        """Draft hidden states for every block.

        Args:
            features: ``[B, T, k*H]`` captured target layers for the context tokens (any float
                dtype; cast to the weights' dtype unless autocast is on for their device).
            block_emb: ``[B, A, bs, H]`` shared embeddings of ``[anchor, mask, ..., mask]``.
            layout: block placement (:func:`dflash.model.attention.training_layout` / ``decode_layout``).
            masks: prebuilt :meth:`build_masks` output (built here when None).

        Returns:
            ``[B, A, bs, H]`` post-norm hidden states; slot ``j`` predicts token ``anchor + j``.
        """
        B, A, bs, H = block_emb.shape
        dtype = self.fc.weight.dtype
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(dtype)
        # Under autocast fc reads the features as they come (bf16 from the target): a cast to the
        # fp32 master dtype would be a [B, T, k*H] fp32 copy that autocast rounds straight back.
        ctx = self.hidden_norm(self.fc(features))                            # [B, T, H]
        x = block_emb.to(dtype).reshape(B, A * bs, H)                        # [B, Q, H]
        qpos = layout.query_positions()
        rope_q = self._rope_table(qpos)
        rope_k = self._rope_table(torch.cat([layout.ctx_positions, qpos], dim=1))
        masks = masks if masks is not None else self.build_masks(layout)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, masks[layer.layer_type])
        return self.norm(x).view(B, A, bs, H)
