"""The target's decode step at a fixed shape, replayed as a CUDA graph on a GPU.

Batch-1 eager decoding of a small target is bound by host overhead, not GPU work: measured on an
H100/H200, about 50 us per aten op, and a verify step of a 30-layer Llama (SmolLM2-135M) costs
~1,000 ops (~100 ms per step in ``dflash.eval``). :class:`StaticTarget` runs the same step with
every shape fixed, so on CUDA it is captured once as a ``torch.cuda.CUDAGraph`` and each later
step is one replay (PyTorch's "CUDA Graphs" notes: warm up on a side stream, capture, replay after
copying new inputs into the static buffers).

What is fixed: the input ``ids [1, W]`` and ``pos [1, W]`` (``W`` = the block size for verify,
1 for greedy decoding), and a KV cache ``k, v [layers, 1, kv_heads, capacity, head_dim]``
allocated once. A step writes its ``W`` keys/values at cache slots ``pos`` (slot ``i`` holds
position ``i``; ``index_copy_``) and every query attends over the whole capacity with the mask
``slot <= query position``, built from tensors. So nothing depends on a tensor's value on the
host, and nothing needs cropping after a rejected draft: the slots past the accepted tokens hold
stale keys that no later query can see before the next step overwrites them. A step shorter than
``W`` (the last, when fewer tokens remain) is padded with whatever ``ids`` held: the padding sits at
positions after the real tokens, so the causal mask hides it from them. The cache starts zeroed,
so a masked slot is never NaN (softmax gives it weight 0, and ``0 * NaN`` would still be NaN).

The forward is written over the Hugging Face model's own modules (``embed_tokens``, each layer's
``input_layernorm``, ``q/k/v/o_proj``, Qwen3's ``q_norm``/``k_norm``, ``mlp``,
``post_attention_layernorm``, ``norm``, ``rotary_emb``, ``lm_head``) in the order of
transformers' ``LlamaDecoderLayer``/``Qwen3DecoderLayer``, for those two families only
(:func:`check_supported`); the features are the captured layers' outputs concatenated as
:meth:`dflash.model.target.Target.collect` orders them. On a CPU (or when capture fails: one
warning line, then eager; :mod:`dflash.model.cuda_graph`) the same forward runs eagerly; that is
what the CPU tests compare with :class:`dflash.eval.decode.CachedTarget`. Grouped-query attention packs the query heads of one key
head into the query length (as transformers' ``pack_gqa``), so SDPA sees equal head counts and
any backend that takes a mask can run it.

:func:`acquire` hands out one instance per (target, width) and :func:`release` takes it back, so
the cache and the graph are reused by the next generation of the same width (a capture costs a
few eager forwards) and a nested generation (an oracle proposer's greedy decode inside a verify
loop) gets an instance of its own.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from dflash.model.cuda_graph import GraphedStep, weights_signature
from dflash.model.target import FIXED_ROPE, FIXED_SHAPE_FAMILIES, Target

__all__ = ["StaticTarget", "UnsupportedTarget", "acquire", "check_supported", "pooled", "release",
           "rounded_capacity"]

FAMILIES = FIXED_SHAPE_FAMILIES
MIN_CAPACITY = 256  # capacities are rounded up to a power of two from here, so generations share one


class UnsupportedTarget(ValueError):
    """The target is not one :class:`StaticTarget` can run; the decode keeps the dynamic cache."""


def check_supported(target: Target) -> None:
    """Refuse a target :class:`StaticTarget` does not reproduce.

    Raises:
        UnsupportedTarget: the model type is not Llama or Qwen3, a layer is not full attention
            (sliding window), the rotary type recomputes frequencies per forward, or the target was
            loaded without its final layers (``need_final=False``).
    """
    hf = target.hf_config
    kind = getattr(hf, "model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedTarget(f"static verify runs {' and '.join(FAMILIES)} targets; this one is {kind!r}")
    types = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise UnsupportedTarget(f"static verify runs full-attention layers only; this target has {sorted(types)}")
    rope = getattr(target.model.model.rotary_emb, "rope_type", "default")
    if rope not in FIXED_ROPE:
        raise UnsupportedTarget(f"static verify needs fixed rotary frequencies; rope_type {rope!r} "
                                "recomputes them per forward")
    if not target.has_final or target.model.get_output_embeddings() is None:
        raise UnsupportedTarget("static verify needs the whole target: load it with need_final=True")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [1, heads, w, d]`` rotated as transformers' ``apply_rotary_pos_emb`` (``cos, sin [1, 1, w, d]``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class StaticTarget:
    """The target's cached forward at a fixed width ``W`` over a fixed-capacity KV cache.

    Called as :class:`dflash.eval.decode.CachedTarget` is: ``run(ids [w], start)`` runs tokens at
    positions ``start .. start+w-1``. ``w <= W`` takes the fixed-shape step (a CUDA-graph replay
    when ``graphs``; padded to ``W``); ``w > W`` (a prefill) runs the same forward eagerly at its
    own length.

    Args:
        target: a Llama or Qwen3 :class:`Target` (:func:`check_supported`).
        width: ``W``, tokens per step (the block size for verify, 1 for greedy decoding).
        capacity: cache positions, at least the generation's last position + ``W``.
        graphs: capture and replay the step as a CUDA graph (CUDA only; ignored on a CPU).

    Raises:
        UnsupportedTarget: as :func:`check_supported`.
    """

    def __init__(self, target: Target, width: int, capacity: int, graphs: bool = True) -> None:
        check_supported(target)
        hf, base = target.hf_config, target.model.model
        # no reference to the Target itself: the pool (acquire) is keyed weakly on it
        self.base, self.lm_head = base, target.model.get_output_embeddings()
        self.layers = list(base.layers)
        self.capture = {i: j for j, i in enumerate(target.layer_ids)}   # layer -> feature slot
        self.width, self.capacity = width, capacity
        dev, dtype = base.embed_tokens.weight.device, base.embed_tokens.weight.dtype
        a = self.layers[0].self_attn
        self.head_dim, self.heads, self.kv_heads = a.head_dim, hf.num_attention_heads, hf.num_key_value_heads
        shape = (len(self.layers), 1, self.kv_heads, capacity, self.head_dim)
        self.k = torch.zeros(shape, device=dev, dtype=dtype)        # zeros: a masked slot is never NaN
        self.v = torch.zeros(shape, device=dev, dtype=dtype)
        self.slots = torch.arange(capacity, device=dev)             # slot i holds position i
        self.ids = torch.zeros(1, width, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, width, dtype=torch.long, device=dev)
        self.offsets = torch.arange(width, device=dev)
        self.asked_graphs = graphs
        self.weights = weights_signature(target.model)   # what the graph reads (acquire checks it)
        self.owner: weakref.ref | None = None   # the target whose pool it returns to (acquire)
        self.step = GraphedStep(self._fixed_step, graphs, dev.type == "cuda", f"the target's {width}-token step")

    def _fixed_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-width step over the static ``ids`` and ``pos`` buffers (what the graph captures)."""
        return self.forward(self.ids, self.pos)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step (None before the first fixed-shape call, on a CPU, or after a failed capture)."""
        return self.step.graph

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last_only: bool = False,
                write: torch.Tensor | None = None, seen: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached forward, no host reads: ``ids, pos [1, w]`` (int64) -> ``(features [1, w, k*H],
        logits [w or 1, V])`` in the target dtype. Writes keys/values at slots ``write [1, w]``
        (default ``pos``: slot i holds position i); query ``j`` sees the slots ``seen[j]`` (bool
        ``[w, capacity]``; default the slots ``<= pos[j]``). A tree step
        (:class:`dflash.eval.static_tree.StaticTreeTarget`) gives both."""
        w, d, g = ids.shape[1], self.head_dim, self.heads // self.kv_heads
        write = pos if write is None else write
        x = self.base.embed_tokens(ids)                                      # [1, w, H]
        cos, sin = self.base.rotary_emb(x, pos)                              # [1, w, d]
        cos, sin = cos[:, None], sin[:, None]
        # a query sees the slots at or before its position; the query rows are packed (group, token)
        seen = self.slots <= pos[0, :, None] if seen is None else seen
        mask = seen.repeat(g, 1)[None, None]                                 # [1, 1, g*w, capacity]
        feats = [None] * len(self.capture)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, w, self.heads, d)
            k = a.k_proj(h).view(1, w, self.kv_heads, d)
            if hasattr(a, "q_norm"):                                         # Qwen3: per-head RMSNorm
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
            self.k[i].index_copy_(2, write[0], k)
            self.v[i].index_copy_(2, write[0], a.v_proj(h).view(1, w, self.kv_heads, d).transpose(1, 2))
            q = q.reshape(1, self.kv_heads, g * w, d)                        # heads h = kv * g + j
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, scale=a.scaling)
            x = x + a.o_proj(o.reshape(1, self.heads, w, d).transpose(1, 2).reshape(1, w, self.heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.capture:
                feats[self.capture[i]] = x
        hidden = self.base.norm(x[0, -1:] if last_only else x[0])
        return torch.cat(feats, dim=-1), self.lm_head(hidden)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, start: int, features: bool = True, last_only: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Tokens ``ids [w]`` at positions ``start..``: ``(features [1, w, k*H] or None, logits [w or 1,
        V])``. The fixed-shape step's outputs are views of static buffers, valid until the next call.

        Raises:
            ValueError: the step would write past the cache's capacity.
        """
        w = ids.shape[0]
        if start + max(w, self.width) > self.capacity:
            raise ValueError(f"positions {start}..{start + max(w, self.width) - 1} exceed the static cache's "
                             f"capacity {self.capacity}")
        if w > self.width:                                                   # prefill: eager, own length
            f, logits = self.forward(ids[None], torch.arange(start, start + w, device=ids.device)[None],
                                     last_only)
            return (f if features else None), logits
        self.ids[0, :w] = ids
        torch.add(self.offsets, start, out=self.pos[0])
        f, logits = self.step()
        f, logits = f[:, :w], logits[w - 1:w] if last_only else logits[:w]
        return (f if features else None), logits

    def keep(self, n: int) -> None:
        """Nothing to crop: slots past ``n`` are masked until overwritten (module docstring)."""


# target -> {(width, graphs): an idle StaticTarget}; weak, so a dropped target frees its caches and graphs
_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rounded_capacity(capacity: int) -> int:
    """``capacity`` rounded up to a power of two, at least :data:`MIN_CAPACITY`."""
    return max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())


def acquire(target: Target, width: int, capacity: int, graphs: bool = True) -> StaticTarget:
    """A :class:`StaticTarget` of ``width`` with room for ``capacity`` positions: the last one released
    for this target, width and ``graphs`` if it has the room and the target's weights have not moved
    (its graph is replayed as captured; one whose capture failed stays eager), else a new one
    (capacity rounded up to a power of two, at least 256, so that most generations fit the first).
    Until :func:`release` no other caller gets it.

    Raises:
        UnsupportedTarget: as :func:`check_supported`.
    """
    run = _POOL.get(target, {}).pop((width, graphs), None)
    fits = run is not None and run.capacity >= capacity + width
    if fits and run.weights == weights_signature(target.model):
        return run
    run = StaticTarget(target, width, rounded_capacity(capacity + width), graphs)
    run.owner = weakref.ref(target)
    return run


def pooled(target: Target, width: int, graphs: bool = True) -> StaticTarget | None:
    """The idle :class:`StaticTarget` of ``target`` and ``width`` (the last generation's), if any:
    e.g. to ask whether its step was captured (``graph is not None``)."""
    return _POOL.get(target, {}).get((width, graphs))


def release(run: StaticTarget) -> None:
    """Hand ``run`` (from :func:`acquire`) back for the next generation of its target and width."""
    target = run.owner() if run.owner is not None else None
    if target is not None:
        _POOL.setdefault(target, {})[(run.width, run.asked_graphs)] = run
