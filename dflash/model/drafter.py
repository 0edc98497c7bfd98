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

import importlib
import math
import warnings

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from csp._guard import check as _check_owner
from dflash.model.attention import BlockLayout, flex_block_mask, sdpa_mask
from dflash.model.build_lock import BUILD_LOCK
from dflash.model.confidence_head import ConfidenceHead
from dflash.model.drafter_config import DrafterConfig, resolve_drafter_config, rope_theta_of
from dflash.model.variants import variant_of

_check_owner("dflash", __file__.rsplit("/", 2)[0])  # eval/export under another 'dflash' (csp._guard)

__all__ = ["DFlashDrafter", "DrafterConfig", "RMSNorm", "apply_rope", "resolve_drafter_config", "rope_theta_of",
           "variant_parts"]  # the config's names are re-exported: the model and its config go together


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x [B, h, N, d]``, ``cos/sin [B, 1, N, d]`` (fp32, cast to x's dtype); the
    rotation every drafter attention applies, in training and in the decoders of :mod:`dflash.eval`."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


_compiled_flex = None


def compiled_flex_attention():
    """The one compiled ``flex_attention`` every CUDA drafter calls (made once, then kept).

    A drafter whose layers are compiled makes it before their first call (:class:`DFlashDrafter`):
    a compiled layer guards on the module globals it reads, so a global that changed from None to
    this function after the first trace would fail that guard, and every layer would compile again
    on shapes it had already seen (a compile during training that can interrupt another stage's
    step: :class:`dflash.run.step_gate.StepGate`)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _flex_attention(q, k, v, block_mask, scale):
    """flex_attention, compiled on CUDA; eager (unfused, for tests/equivalence) elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
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
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
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


def variant_parts(cfg: DrafterConfig, where: str) -> dict[str, nn.Module]:
    """What the config's variant adds to every decoder layer (``where = "decoder_layer"``) or to
    the drafter (``"drafter"``): its module's ``decoder_layer_parts`` / ``drafter_parts``
    (:mod:`dflash.model.variants` says the protocol); ``{}`` for a variant with no module."""
    module = variant_of(cfg.variant).module
    if module is None:
        return {}
    build = getattr(importlib.import_module(module), f"{where}_parts", None)
    return build(cfg) if build is not None else {}


class DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.block = c.block_size
        self.attention_conv = self.mlp_conv = None  # DFlash2's, around each sublayer (dflash.model.dflash2)
        parts = variant_parts(c, "decoder_layer")
        for name, part in parts.items():
            setattr(self, name, part)
        self.part_names = tuple(parts)

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
        with BUILD_LOCK:  # never beside a target's build in another thread (dflash.model.build_lock)
            self._build(cfg, seed)

    def _build(self, cfg: DrafterConfig, seed: int | None) -> None:
        cfg.check_resolved()
        self.cfg = cfg
        self._trained_block_size = cfg.block_size
        H, k = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.types)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.output_block: nn.Module | None = None  # a variant's map of the post-norm hidden states
        parts = variant_parts(cfg, "drafter")  # DFlash2's selector, XPress's refiner, ...
        for name, part in parts.items():
            setattr(self, name, part)
        self.part_names = tuple(parts)
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(H)
        # fp32 RoPE frequencies kept outside the module's buffers, so .to(bf16) cannot round them
        self._inv_freq = (1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).double()
                                                  / cfg.head_dim)).float()
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # copies per device, made once
        self.reset_parameters(seed)
        if cfg.kernels != "torch" or cfg.compile or cfg.precision != "bf16":  # same weights, same keys
            from dflash.model.drafter_kernels import apply_kernels

            if cfg.compile and cfg.attn_implementation == "flex_attention":
                compiled_flex_attention()  # before any layer is traced: see its docstring
            apply_kernels(self, cfg.kernels, cfg.compile, RMSNorm, MLP, precision=cfg.precision,
                          fp8_recipe=cfg.fp8_recipe)

    def serve_at_block_size(self, block_size: int) -> None:
        """Draft blocks of ``block_size`` tokens (anchor included) from now on: a drafter trained
        at one block size, decoded at a smaller one. Published DFlash drafters are trained at 16 and
        served at 8 (z-lab's ``spec_generate`` and the serving engines take the block size as a
        setting): a shorter block costs the target a narrower verify forward and the drafter a
        shorter block, for the positions a long block rarely reaches. No weight depends on the
        block size (positions are RoPE; a block attends to itself and its context whatever its
        length); DFlash2's convolution restarts at every block of the new size.

        Raises:
            ValueError: ``block_size`` below 2 or above the size the drafter was trained at
                (positions it never trained on).
        """
        trained = self.trained_block_size
        if not 2 <= block_size <= trained:
            raise ValueError(f"block size {block_size}: serve this drafter at 2 .. {trained} tokens per "
                             f"block (it was trained at {trained})")
        self.cfg = msgspec.structs.replace(self.cfg, block_size=block_size)
        for layer in self.layers:
            layer.block = block_size

    @property
    def trained_block_size(self) -> int:
        """The block size the drafter was built (and trained) at, whatever it is served at."""
        return self._trained_block_size

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Backbone: ``N(0, 0.02)`` matrices, unit norms. The variant's parts (DFlash2's
        convolutions and selector, XPress's refiner, ...) and the confidence head are skipped in
        that loop and initialised after it, each by its own ``reset_parameters(generator)``, so the
        backbone's draws, and with them a fresh drafter's hidden states, equal the plain DFlash
        drafter's of the same seed."""
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed) if seed is not None else None
        parts = [getattr(owner, n) for owner in (*self.layers, self) for n in owner.part_names]
        if self.cfg.confidence_head:
            parts.append(self.confidence_head)
        added = {id(p) for m in parts for p in m.parameters()}
        for name, p in self.named_parameters():
            if id(p) in added:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for part in parts:  # layers' parts, the drafter's, the confidence head: the order they were built
            part.reset_parameters(gen)

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
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # only x is kept; the layer runs again in the backward ([drafter].activation_checkpointing)
                x = checkpoint(layer, x, ctx, rope_q, rope_k, masks[layer.layer_type], use_reentrant=False)
            else:
                x = layer(x, ctx, rope_q, rope_k, masks[layer.layer_type])
        return self.output(x).view(B, A, bs, H)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output ``x [..., H]`` to the hidden states every reader takes (the LM
        head, DFlash2's selector, the confidence head): ``norm``, then the variant's
        ``output_block`` when it has one. Every decode path ends its forward here."""
        x = self.norm(x)
        return x if self.output_block is None else self.output_block(x)
