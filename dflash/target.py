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

Layer ids are 0-based decoder layer indices; the captured tensor is that layer's *output*
(``output_hidden_states[i + 1]`` in Hugging Face terms), as in the public DFlash code.
"""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
from torch import nn

__all__ = [
    "PRESETS",
    "SharedHead",
    "Target",
    "TargetConfig",
    "build_hf_config",
    "check_overrides",
    "default_layer_ids",
    "document_attention_mask",
    "document_causal_mask",
    "load_shared_head",
    "load_target",
    "resolve_dtype",
    "resolve_layer_ids",
]

# Qwen3 shapes (public Qwen3 config.json files); "tiny" is a CPU debug size.
_QWEN3_COMMON: dict[str, Any] = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 384,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3_COMMON, "hidden_size": 2048, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "intermediate_size": 6144, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3_COMMON, "hidden_size": 4096, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "intermediate_size": 12288, "tie_word_embeddings": False},
}


_BUILD_LOCK = threading.Lock()


class TargetConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The graph file's ``[target]`` table.

    Attributes:
        path: local Hugging Face model directory (never a hub id: nothing is downloaded), or None
            for a ``preset``-shaped model with seeded random weights.
        preset: shape used when ``path`` is None: "tiny" | "qwen3-0.6b" | "qwen3-1.7b" | "qwen3-8b".
        overrides: transformers config fields applied on top of the preset or the local config;
            a key the config class does not know is an error (:func:`check_overrides`).
        vocab_size: None = from the preset / local config; the run sets it from the tokenizer for
            "tiny".
        seed: random-init seed (only with ``path = None``).
        dtype: "auto" (bf16 on CUDA, fp32 on CPU) | "bfloat16" | "float16" | "float32".
        attn_implementation: "sdpa" | "flex_attention" | "eager".
        layer_ids: 0-based decoder layers whose outputs feed the drafter; None = the DFlash evenly
            spaced choice for the drafter's layer count (:func:`default_layer_ids`).
        tokenizer: tokenizer spec for the data path ("builtin:tiny" or a local directory);
            None = ``path`` (or "builtin:tiny" without a path). Not used by the model code.
    """

    path: str | None = None
    preset: Literal["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"] = "tiny"
    overrides: dict[str, Any] = {}
    vocab_size: int | None = None
    seed: int = 0
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: Literal["sdpa", "flex_attention", "eager"] = "sdpa"
    layer_ids: list[int] | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"target.vocab_size must be >= 1, got {self.vocab_size}")


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """``"auto"`` -> bf16 on CUDA, fp32 elsewhere; otherwise the named torch dtype."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, dtype)


def known_config_keys(config_class, loaded=None) -> set[str]:
    """The keys a transformers config of ``config_class`` understands.

    A key is known if it is a parameter of ``__init__`` of the class or a base class, or a public,
    non-method attribute of a default instance (this covers what ``PretrainedConfig.__init__``
    sets and ``attribute_map`` aliases, which ``to_dict()`` leaves out), or of ``loaded`` (a config
    read from a ``config.json``, which may carry model-specific extras).
    """
    import inspect

    keys: set[str] = set()
    for klass in config_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            keys |= {n for n, p in inspect.signature(init).parameters.items()
                     if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    keys |= set(getattr(config_class, "attribute_map", {}))
    for obj in (config_class(), loaded):
        if obj is not None:
            keys |= {k for k in dir(obj) if not k.startswith("_")
                     and not callable(getattr(config_class, k, None))}
    return keys


def check_overrides(overrides: dict[str, Any], config_class, loaded=None) -> None:
    """Reject ``target.overrides`` keys that ``config_class`` does not know (typos are otherwise
    set as inert attributes and silently ignored).

    Raises:
        ValueError: one line naming the first unknown key, the config class, and close matches.
    """
    import difflib

    known = known_config_keys(config_class, loaded)
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else \
                f"see the fields of transformers.{config_class.__name__}"
            raise ValueError(f"target.overrides: {key!r} is not a {config_class.__name__} field; "
                             f"{hint}")


def build_hf_config(cfg: TargetConfig):
    """The transformers config for ``cfg`` (local ``config.json`` or preset), overrides applied.

    Raises:
        FileNotFoundError: ``cfg.path`` is not a directory, or has no ``config.json``.
        ValueError: a ``target.overrides`` key the config class does not know
            (:func:`check_overrides`).
    """
    from transformers import AutoConfig, Qwen3Config

    if cfg.path is not None:
        if not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"target.path = {cfg.path!r} does not exist (or is not a directory); "
                                    "point it at a local Hugging Face model directory")
        if not (Path(cfg.path) / "config.json").is_file():
            raise FileNotFoundError(f"target.path = {cfg.path!r} has no config.json; "
                                    "point it at a local Hugging Face model directory")
        hf = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        check_overrides(cfg.overrides, type(hf), hf)
        for key, value in cfg.overrides.items():
            setattr(hf, key, value)
    else:
        check_overrides(cfg.overrides, Qwen3Config)
        fields = {**PRESETS[cfg.preset], **cfg.overrides}
        hf = Qwen3Config(**fields)
    if cfg.vocab_size is not None:
        hf.vocab_size = cfg.vocab_size
    hf._attn_implementation = cfg.attn_implementation
    return hf


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash evenly spaced target layers: exactly the public ``build_target_layer_ids`` rule
    (z-lab dflash, SGLang, vLLM speculators), so an exported drafter matches what they rebuild.

    One layer: ``[L // 2]``. Otherwise ``int(round(1 + i * (L - 4) / (k - 1)))`` for ``i < k``,
    i.e. evenly spaced over ``[1, L - 3]`` (36 layers, k=5 -> ``[1, 9, 17, 25, 33]``; 6 layers,
    k=2 -> ``[1, 3]``). The rule never takes the last layer, whose output feeds the final norm and
    is not what the public drafters are trained on.

    Where the rule cannot give ``k`` distinct layers short of the last one (``k >= 2`` needs
    ``L >= k + 3``; ``k = 1`` needs ``L >= 3``), there is no public choice to follow: rather than
    invent one (an earlier fallback picked ``[0, 2, 3, 5]`` on a 6-layer target, last layer
    included, which the vLLM speculators converter rejects), this raises.

    Raises:
        ValueError: the target is too shallow for the rule; the message says to set
            ``target.layer_ids`` or lower ``drafter.num_layers``.
    """
    L, k = num_target_layers, num_draft_layers
    if k < 1:
        raise ValueError(f"drafter.num_layers must be >= 1, got {k}")
    if k == 1:
        ids = [L // 2]
    else:
        ids = [int(round(1 + i * (L - 4) / (k - 1))) for i in range(k)]
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > L - 2:
        fix = (f"set drafter.num_layers <= {max(L - 3, 1)} or list target.layer_ids explicitly"
               if L >= 3 else "list target.layer_ids explicitly")
        raise ValueError(
            f"drafter.num_layers = {k}: a {L}-layer target is too shallow for the DFlash default "
            "target layers ([L//2] for one drafter layer, else k distinct layers evenly spaced in "
            f"[1, L-3], never the last layer); {fix}")
    return ids


def resolve_layer_ids(cfg: TargetConfig, hf_config, num_draft_layers: int) -> list[int]:
    """``cfg.layer_ids`` (sorted) or :func:`default_layer_ids`, checked against the target depth.

    Raises:
        ValueError: ids out of ``[0, L-1]`` or repeated.
    """
    L = hf_config.num_hidden_layers
    if cfg.layer_ids is None:
        return default_layer_ids(L, num_draft_layers)
    ids = sorted(cfg.layer_ids)
    if not ids or ids[0] < 0 or ids[-1] >= L or len(set(ids)) != len(ids):
        raise ValueError(f"target.layer_ids = {cfg.layer_ids} must be distinct ids in [0, {L - 1}]")
    return ids


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool mask, True = may attend: causal and within one packed document.

    ``doc_ids`` ``[B, T]`` (-1 = padding). A padding query attends only to itself, so no row is
    empty (SDPA returns NaN for an all-False row); padding outputs are finite and unused.
    Memory is ``B * T^2`` bytes, independent of the head count.
    """
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device)
    causal = idx[None, :] <= idx[:, None]                                  # [T, T]
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    diag = torch.eye(T, dtype=torch.bool, device=doc_ids.device)
    return ((same & causal) | diag)[:, None]


def document_attention_mask(doc_ids: torch.Tensor, attn_implementation: str,
                            dtype: torch.dtype = torch.float32):
    """The document-causal mask in the form ``attn_implementation`` reads it.

    transformers passes a ready 4D mask through unchanged, and each attention path reads it its
    own way, so the form must match the path:

    * ``"sdpa"``: the bool mask of :func:`document_causal_mask` (True = attend);
    * ``"eager"``: an additive ``[B, 1, T, T]`` mask in ``dtype``: 0 where allowed and
      ``finfo(dtype).min`` where not (eager *adds* the mask to the scores, so a bool mask would
      add +1 to allowed keys and mask nothing);
    * ``"flex_attention"``: a ``BlockMask`` of the same rule.

    Raises:
        ValueError: another ``attn_implementation``.
    """
    if attn_implementation == "sdpa":
        return document_causal_mask(doc_ids)
    if attn_implementation == "eager":
        allowed = document_causal_mask(doc_ids)
        return torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)
    if attn_implementation == "flex_attention":
        return _document_block_mask(doc_ids)
    raise ValueError(f"target.attn_implementation = {attn_implementation!r}: expected "
                     "'sdpa', 'flex_attention' or 'eager'")


def _document_block_mask(doc_ids: torch.Tensor):
    """The flex_attention ``BlockMask`` equivalent of :func:`document_causal_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def mask_mod(b, h, q, kv):
        same = (doc_ids[b, q] == doc_ids[b, kv]) & (doc_ids[b, q] >= 0)
        return ((kv <= q) & same) | (q == kv)

    return create_block_mask(mask_mod, B, None, T, T, device=doc_ids.device)


def _param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed, so random weights do not depend on build order/truncation."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


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


class SharedHead(nn.Module):
    """The target's frozen token embedding and LM head, shared by the drafter.

    ``embed(ids [..]) -> [.., H]``; ``logits(hidden [.., H]) -> [.., V]`` (``hidden @ W^T``, no
    bias, in the head's dtype; callers pick the positions first, never the whole sequence).
    Not part of the drafter's state_dict; never trained.
    """

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
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


def _read_safetensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
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
        found = _read_safetensors(Path(cfg.path), names)
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

    def __init__(self, model: nn.Module, hf_config, layer_ids: list[int], need_final: bool) -> None:
        super().__init__()
        self.model = model
        self.hf_config = hf_config
        self.layer_ids = list(layer_ids)
        self.has_final = need_final
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
        mask = document_attention_mask(doc_ids, self.hf_config._attn_implementation,
                                       self.model.model.embed_tokens.weight.dtype)
        out = self.model.model(input_ids=input_ids, position_ids=position_ids,
                               attention_mask=mask, use_cache=False)
        layer_hidden = self.collect()
        return layer_hidden, (out.last_hidden_state if need_final else None)


def _build(cfg: TargetConfig, device, num_draft_layers: int, need_final: bool):
    """The transformers model of :func:`load_target` (called under ``_BUILD_LOCK``)."""
    from transformers import AutoModelForCausalLM

    hf = build_hf_config(cfg)
    layer_ids = resolve_layer_ids(cfg, hf, num_draft_layers)
    dtype = resolve_dtype(cfg.dtype, device)
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
    """
    # One build at a time per process: transformers imports lazily and builds on the meta device
    # through process-global patches; two replicas' threads loading at once failed the import or
    # left one model with meta tensors ("Cannot copy out of meta tensor" in target[0]).
    with _BUILD_LOCK:
        model, hf, layer_ids = _build(cfg, device, num_draft_layers, need_final)
    if not need_final:
        model.lm_head = None  # the features never need the LM head; free its [V, H] weight
    model.eval().requires_grad_(False)
    return Target(model, hf, layer_ids, need_final)
