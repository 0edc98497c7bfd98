"""The frozen target model: hidden-state capture for DFlash training, and its shared head.

A DFlash drafter is conditioned on the outputs of ``k`` target decoder layers, concatenated per
token (``[B, T, k*H]``), and shares the target's token embedding and LM head. This module

* builds the target from a local Hugging Face directory or from a Qwen3-shaped preset with seeded
  random weights (tests, benchmarks),
* runs it over packed rows with document-aware causal attention and captures the chosen layers
  with forward hooks (never ``output_hidden_states=True`` for every layer, never full-vocabulary
  logits over the whole sequence),
* drops the decoder layers after the last captured one when the final hidden state is not needed,
* loads the frozen embedding / LM head alone (:func:`load_shared_head`) without building the
  target, so the drafter stage of an 8B target holds only those two matrices.

Its parts, each a module of its own and re-exported here (``from dflash.model.target import ...``):
:mod:`dflash.model.target_config` (``[target]``, presets, the transformers config),
:mod:`dflash.model.layer_ids` (which layers are captured), :mod:`dflash.model.document_mask` (the attention
mask over packed documents) and :mod:`dflash.model.shared_head` (:class:`SharedHead`).

Layer ids are 0-based decoder layer indices; the captured tensor is that layer's *output*
(``output_hidden_states[i + 1]`` in Hugging Face terms), as in the public DFlash code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash.model.build_lock import BUILD_LOCK
from dflash.model.document_mask import document_attention_mask, document_causal_mask
from dflash.model.layer_ids import default_layer_ids, resolve_layer_ids
from dflash.model.shared_head import SharedHead, read_safetensors
from dflash.model.target_config import (
    PRESETS,
    TargetConfig,
    build_hf_config,
    check_overrides,
    for_generation,
    resolve_dtype,
)
from dflash.model.target_engine import VARLEN, CompiledLayers, check_engine, varlen_kwargs
from dflash.seeding import PARAMS, derive_seed

__all__ = [
    "FIXED_ROPE",
    "FIXED_SHAPE_FAMILIES",
    "PRESETS",
    "SharedHead",
    "Target",
    "TargetConfig",
    "build_hf_config",
    "check_overrides",
    "default_layer_ids",
    "document_attention_mask",
    "document_causal_mask",
    "for_generation",
    "load_shared_head",
    "load_target",
    "resolve_dtype",
    "resolve_layer_ids",
]


FIXED_SHAPE_FAMILIES = ("llama", "qwen3")
"""Target families whose decoder layers this project re-runs op by op at fixed shapes, over a static
KV cache (:mod:`dflash.eval.static_target`, :mod:`dflash.model.slots`): their layers' order of
operations is written out there, so a new family is added only with a test against transformers'."""
FIXED_ROPE = ("default", "linear", "llama3", "yarn")
"""Rotary types whose frequencies are fixed when the model is built; "dynamic" and "longrope"
recompute them from the positions on the host side of a forward, which a captured step cannot."""


def _param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed, so random weights do not depend on build order/truncation."""
    return derive_seed(seed, name, salt=PARAMS)


def _random_head(hf_config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random ``(embed [V, H], lm_head [V, H])`` fp32 on CPU, shared by target and head.

    Drawn on CPU from a dedicated generator so that :func:`load_target` and
    :func:`load_shared_head` produce bit-identical weights on any device. Tied configs return
    the same tensor twice.
    """
    V, H = hf_config.vocab_size, hf_config.hidden_size
    std = getattr(hf_config, "initializer_range", 0.02)
    gen = torch.Generator().manual_seed(_param_seed(seed, "embed_tokens"))
    embed = torch.empty(V, H).normal_(0.0, std, generator=gen)
    if getattr(hf_config, "tie_word_embeddings", False):
        return embed, embed
    gen = torch.Generator().manual_seed(_param_seed(seed, "lm_head"))
    return embed, torch.empty(V, H).normal_(0.0, std, generator=gen)


@torch.no_grad()
def _random_init_(model: nn.Module, hf_config, seed: int) -> None:
    """Re-initialise every weight from a generator seeded by (seed, parameter name).

    Norm weights are ones, biases zeros, matrices ``N(0, initializer_range)`` drawn on the
    parameter's device (so CPU and CUDA runs differ, but truncation and build order do not
    matter); embedding and LM head come from :func:`_random_head` (device-independent).
    """
    std = getattr(hf_config, "initializer_range", 0.02)
    embed, head = _random_head(hf_config, seed)
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.copy_(embed)
        elif name == "lm_head.weight":
            p.copy_(head)
        elif "norm" in name.rsplit(".", 2)[-2]:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            gen = torch.Generator(device=p.device).manual_seed(_param_seed(seed, name))
            p.normal_(0.0, std, generator=gen)


def load_shared_head(cfg: TargetConfig, device: torch.device | str,
                     dtype: torch.dtype | None = None) -> SharedHead:
    """The target's embedding and LM head, without building the target.

    Local dir: reads ``model.embed_tokens.weight`` and ``lm_head.weight`` from safetensors
    (``tie_word_embeddings`` or a missing ``lm_head.weight`` -> the embedding). Random init: the
    same seeded tensors :func:`load_target` puts into the target. ``dtype`` None -> ``cfg.dtype``.

    Raises:
        KeyError: the checkpoint has no ``model.embed_tokens.weight``.
    """
    hf = build_hf_config(cfg)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if cfg.path is None:
        embed, head = _random_head(hf, cfg.seed)
    else:
        names = ["model.embed_tokens.weight", "lm_head.weight"]
        found = read_safetensors(Path(cfg.path), names)
        if names[0] not in found:
            raise KeyError(f"{cfg.path}: no tensor 'model.embed_tokens.weight'")
        embed = found[names[0]]
        tied = getattr(hf, "tie_word_embeddings", False) or names[1] not in found
        head = embed if tied else found[names[1]]
    tied = head is embed
    embed = embed.to(device=device, dtype=dtype)
    head = embed if tied else head.to(device=device, dtype=dtype)
    return SharedHead(embed, head)


class Target(nn.Module):
    """A frozen causal LM that returns the drafter's features.

    Attributes:
        model: the transformers ``*ForCausalLM`` (layers after the last captured one removed, and
            no LM head use, when built with ``need_final=False``).
        hf_config: its transformers config (``num_hidden_layers`` is the *original* depth).
        layer_ids: captured 0-based decoder layers (ascending).
        has_final: whether the final norm and all layers are kept.
    """

    def __init__(self, model: nn.Module, hf_config, layer_ids: list[int], need_final: bool,
                 compiled: CompiledLayers | None = None) -> None:
        super().__init__()
        self.model = model
        self.hf_config = hf_config
        self.layer_ids = list(layer_ids)
        self.has_final = need_final
        self.compiled = compiled  # [target].compile: the decoder layers' compiled forwards
        self._captured: dict[int, torch.Tensor] = {}
        layers = self.decoder_layers
        for i in self.layer_ids:
            layers[i].register_forward_hook(self._hook(i))

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    def _hook(self, i: int):
        def hook(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def collect(self) -> torch.Tensor:
        """Concatenate (and clear) the layer outputs captured by the last forward: ``[B, T, k*H]``."""
        try:
            out = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        finally:
            self._captured.clear()
        return out

    def shared_head(self) -> SharedHead:
        """A :class:`SharedHead` viewing this target's own embedding/LM head (no copy)."""
        emb = self.model.get_input_embeddings().weight
        out = self.model.get_output_embeddings()
        if out is None:
            raise RuntimeError("this target was loaded with need_final=False and has no LM head")
        return SharedHead(emb, emb if out.weight is emb else out.weight)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                need_final: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features for packed rows.

        Args:
            input_ids, position_ids: ``[B, T]`` int64 (positions restart at 0 per document).
            doc_ids: ``[B, T]`` int (-1 = padding); attention never crosses documents.
            need_final: also return the final post-norm hidden state.

        Returns:
            ``layer_hidden [B, T, k*H]`` and ``final_hidden [B, T, H]`` or None (target dtype).

        Raises:
            RuntimeError: ``need_final`` on a target built with ``need_final=False``.
        """
        if need_final and not self.has_final:
            raise RuntimeError("Target was loaded with need_final=False (layers after the last "
                               "captured one dropped); load it with need_final=True")
        impl, extra = self.hf_config._attn_implementation, {}
        compiled = self.compiled is not None and self.compiled.use_for(input_ids.shape)
        if impl == VARLEN:  # no mask: one causal sequence per document (dflash.model.target_engine)
            mask, extra = None, varlen_kwargs(doc_ids, doc_ids.shape[1] if compiled else None)
            if compiled:  # the number of sequences varies per batch: one dynamic graph from the first
                # call, not a static one and then, at the first batch with another count, a
                # recompile of every layer that stalls the stage for seconds
                import torch._dynamo

                torch._dynamo.mark_dynamic(extra["cu_seq_lens_q"], 0)
        else:
            mask = document_attention_mask(doc_ids, impl, self.model.model.embed_tokens.weight.dtype)
        out = self.model.model(input_ids=input_ids, position_ids=position_ids,
                               attention_mask=mask, use_cache=False, **extra)
        layer_hidden = self.collect()
        return layer_hidden, (out.last_hidden_state if need_final else None)


def _build(cfg: TargetConfig, device, num_draft_layers: int, need_final: bool):
    """The transformers model of :func:`load_target` (called under :data:`dflash.model.build_lock.BUILD_LOCK`)."""
    from transformers import AutoModelForCausalLM

    hf = build_hf_config(cfg)
    layer_ids = resolve_layer_ids(cfg, hf, num_draft_layers)
    dtype = resolve_dtype(cfg.dtype, device)
    check_engine(cfg.quantization, cfg.attn_implementation, device, dtype)
    if cfg.attn_implementation == VARLEN:
        from dflash.model.target_engine import register_varlen

        register_varlen()  # before transformers checks the attention name
    build_cfg = hf
    if not need_final:
        build_cfg = hf.__class__.from_dict(hf.to_dict())
        build_cfg.num_hidden_layers = layer_ids[-1] + 1
        if getattr(build_cfg, "layer_types", None) is not None:
            build_cfg.layer_types = list(hf.layer_types[: layer_ids[-1] + 1])
        build_cfg._attn_implementation = cfg.attn_implementation
    if cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, config=build_cfg, dtype=dtype, local_files_only=True,
            attn_implementation=cfg.attn_implementation)
        model.to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(build_cfg, dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation)
        _random_init_(model, hf, cfg.seed)
    return model, hf, layer_ids


def load_target(cfg: TargetConfig, device: torch.device | str, num_draft_layers: int,
                need_final: bool = True) -> Target:
    """Build the frozen target on ``device``.

    Args:
        cfg: the ``[target]`` table.
        device: where it lives.
        num_draft_layers: drafter depth; picks the default ``layer_ids`` (one per drafter layer,
            as in the public DFlash models).
        need_final: keep every layer and the final norm (the loss needs target logits, or eval).
            False keeps only layers ``0..max(layer_ids)``: a local checkpoint is loaded with a
            truncated config so the dropped layers are never materialised.

    Raises:
        ValueError: a ``layer_ids`` entry is out of range.
        ConfigError: an engine setting (``quantization``, ``attn_implementation = "varlen"``)
            this device or install cannot run (:func:`dflash.model.target_engine.check_engine`).
    """
    # One build at a time per process (dflash.model.build_lock): two replicas' threads loading at
    # once failed transformers' lazy import or left one model with meta tensors ("Cannot copy out of
    # meta tensor" in target[0]).
    with BUILD_LOCK:
        model, hf, layer_ids = _build(cfg, device, num_draft_layers, need_final)
    if not need_final:
        model.lm_head = None  # the features never need the LM head; free its [V, H] weight
    model.eval().requires_grad_(False)
    if cfg.quantization == "fp8":  # after the weights are final; decoder layers only (head shared)
        from dflash.model.target_engine import quantize_fp8

        quantize_fp8(model.model.layers)
    compiled = None
    if cfg.compile:
        compiled = CompiledLayers(model.model.layers, None if cfg.compile_mode == "default" else cfg.compile_mode)
    return Target(model, hf, layer_ids, need_final, compiled)
