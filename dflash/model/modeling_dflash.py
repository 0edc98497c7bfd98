"""DFlash drafter as a transformers model, for ``trust_remote_code`` loading of an exported drafter.

``python -m dflash.export`` copies this file into the export directory and points ``auto_map`` at
it, so a transformers user needs no other package::

    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)
    hidden = drafter(target_hidden=feats, noise_embedding=block_emb)      # [B, Q, H]
    logits = drafter.compute_logits(hidden[:, 1:], target.lm_head)        # the drafted tokens

Without ``trust_remote_code=True`` transformers ignores this file and silently builds a plain
``Qwen3Model`` from ``config.json`` (``model_type = "qwen3"``), which is not a drafter.

The class presents the interface of z-lab's ``dflash_generate`` loop (``model.block_size``,
``model.mask_token_id``, ``model.target_layer_ids``, ``model.config``, :meth:`compute_logits`, a
draft KV cache through ``past_key_values``/``use_cache``, and a forward that returns the hidden
state tensor), so ``dflash_generate(AutoModel.from_pretrained(DIR, trust_remote_code=True),
target, ...)`` decodes with it (tested in ``tests/dflash/export/test_zlab.py`` where z-lab's package is
importable). It also has z-lab's own entry point, with the same signature and return::

    out = drafter.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[eos])  # [1, N+n]

(greedy: the target's own greedy text; ``temperature > 0``: speculative sampling, a DFlash2
drafter's block drawn by its candidate selector's sampled walk, an XPress drafter's from its
refined logits; tested in
``tests/dflash/model/test_spec_generate.py`` against the target's ``generate`` and z-lab's ``spec_generate``, and
in ``tests/dflash/model/test_spec_generate_dflash2_sampled.py`` against the target's exact sampling distribution
and z-lab's per-step ``q`` and acceptances).

Weights are initialised (``_init_weights``) only where transformers has not loaded them: the
post-load initialisation that transformers 5.0-5.12 run on ``trust_remote_code`` classes skips
every parameter flagged ``_is_hf_initialized``, so loading never re-randomises an exported weight.

It imports only torch and transformers (never ``dflash``), and computes what
``dflash.model.drafter.DFlashDrafter`` computes for one block after a context (tested in
``tests/dflash/export/test_export.py`` against :func:`dflash.export.load_exported`). Parameter names are the
public DFlash ones: ``fc``, ``hidden_norm``, ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``,
``layers.N.{input,post_attention}_layernorm``, ``norm``. The drafter shares the target's token
embedding and LM head, which are not part of it: embed the block with the target's embedding and
apply the target's LM head to the output.
"""

from __future__ import annotations

import heapq
import inspect
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

    def forward(self, x, ctx, rope_q, rope_k, mask, cache=None, layer_idx: int = 0) -> torch.Tensor:
        """``mask``: a bool ``[B, 1, Q, K]`` tensor, or a callable of the key count ``K`` giving one
        (the keys of a cached call are the cached ones plus this call's). ``cache``: a transformers
        ``Cache`` that gets this call's rotated keys/values (context then block) for ``layer_idx``."""
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, -1, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, -1, self.nkv, self.d).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_k)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        if callable(mask):
            mask = mask(k.shape[2])
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

    def forward(self, x, ctx, rope_q, rope_k, mask, cache=None, layer_idx: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask, cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rope_theta(c: Qwen3Config) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10_000.0)))


def _dflash_value(c: Qwen3Config, name: str, default=None):
    """A DFlash setting: ``config.dflash_config[name]``, else ``config.<name>``, else ``default``
    (where the public DFlash drafters look, so their config files and ours both load)."""
    dfc = getattr(c, "dflash_config", None) or {}
    return dfc[name] if name in dfc else getattr(c, name, default)


def _init_unless_loaded(param, fill) -> None:
    """``fill(param)`` in place unless transformers marked ``param`` as loaded (``_is_hf_initialized``).

    transformers 5.0-5.12 call ``_init_weights`` on a ``trust_remote_code`` model *after* loading
    its weights; an unguarded in-place init there replaces every loaded weight with a random one.
    """
    if param is None or getattr(param, "_is_hf_initialized", False):
        return
    with torch.no_grad():
        fill(param)


# -- speculative decoding with a target model (z-lab's ``spec_generate`` contract): the target
# verifies each drafted block in one forward; greedy decoding keeps the target's own tokens and
# sampling keeps its distribution (Leviathan et al. 2023, "Fast Inference from Transformers via
# Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
# with Speculative Sampling").


def _check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if not (math.isfinite(temperature) and temperature >= 0) or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need a finite temperature >= 0 (0: greedy), 0 < top_p <= 1 and top_k >= 0 (0: all); "
                         f"got temperature={temperature}, top_p={top_p}, top_k={top_k}")


def _probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """fp32 ``[..., V]`` sampling distribution of ``logits / temperature`` restricted to the
    ``top_k`` largest (0 = all), then to the smallest set of them whose mass reaches ``top_p``."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        vals, idx = torch.topk(scores, top_k, dim=-1)  # exactly k, ties broken by topk
        scores = torch.full_like(scores, float("-inf")).scatter(-1, idx, vals)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # mass before a token already reaches top_p
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [..., V]`` -> ``[...]`` (long)."""
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def _speculative_accept(drafted: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Accept a prefix of ``drafted [L]`` (drawn from ``q [L, V]``) against the target's ``p [L+1, V]``:
    token ``j`` is kept with probability ``min(1, p_j/q_j)``; the first rejected one is replaced by
    a draw from ``norm(max(0, p - q))``, and a full acceptance adds a draw from ``p[L]``. The output is
    distributed as the target's (Leviathan et al. 2023). Returns ``(accepted count, next token [])``."""
    L = drafted.shape[0]
    rows = torch.arange(L, device=drafted.device)
    p_tok, q_tok = p[rows, drafted], q[rows, drafted]
    keep = torch.rand_like(q_tok) * q_tok < p_tok  # u < p/q without dividing by q = 0
    n = int(keep.long().cumprod(0).sum())
    if n == L:
        return n, _draw(p[L])
    residual = (p[n] - q[n]).clamp_min(0.0)
    return n, _draw(residual if float(residual.sum()) > 0 else p[n])


def _new_cache(config):
    """A ``DynamicCache`` that can be cropped back after a block, also past a sliding window."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if hasattr(cache, "activate_past_recording"):  # transformers >= 5: keep sliding layers' past
        cache.activate_past_recording()
    return cache


def _crop(cache, length: int) -> None:
    """Drop the cache's entries past the first ``length`` tokens (a negative ``crop`` argument
    means "remove that many" on every transformers version the project allows)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _cache_kwarg(target: nn.Module) -> str:
    """The name ``target.forward`` takes its KV cache by: ``cache`` on transformers that renamed
    ``past_key_values`` (which they still accept, with a FutureWarning), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _output_head(target: nn.Module) -> nn.Module:
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


# -- tree verification: the block's ``budget`` most probable prefixes under the drafter's
# per-position marginals, verified in one target forward under a tree attention mask (DDTree, Ringel
# & Romano 2025; SGLang's tree verify for DFlash). The same tree as dflash.eval.tree.best_first
# (a test holds the two equal); written out here because this file ships alone with an export
# (dflash.eval.tree_decode uses the mask and the cache pruning below).


def _tree(logits: torch.Tensor, budget: int) -> list[tuple[int, int, int]]:
    """``logits [S, V]`` of the drafted positions -> one ``(parent, depth, token)`` per node, most
    probable prefix first (``parent`` -1: the anchor; a parent precedes its children)."""
    logp, ids = torch.log_softmax(logits.float(), -1).topk(min(budget, logits.shape[-1]), dim=-1)
    logp, ids = logp.tolist(), ids.tolist()
    heap, nodes = [(-logp[0][0], 0, 0, 0.0, -1)], []
    while heap and len(nodes) < budget:
        neg, d, rank, parent_lp, parent = heapq.heappop(heap)
        nodes.append((parent, d, ids[d][rank]))
        if rank + 1 < len(ids[d]):   # the next sibling, then the best child: neither more probable
            heapq.heappush(heap, (-(parent_lp + logp[d][rank + 1]), d, rank + 1, parent_lp, parent))
        if d + 1 < len(ids):
            heapq.heappush(heap, (neg - logp[d + 1][0], d + 1, 0, -neg, len(nodes) - 1))
    return nodes


def tree_visibility(parent: list[int]) -> torch.Tensor:
    """Bool ``[1 + B, 1 + B]`` over the rows ``[anchor, node_1 .. node_B]`` (node ``i`` under node
    ``parent[i]``, -1 for the anchor; parents before children): row 0 sees itself, node ``i``
    (row ``i + 1``) the anchor, its ancestors and itself."""
    B = len(parent)
    block = torch.zeros(1 + B, 1 + B, dtype=torch.bool)
    block[:, 0] = True
    for i, p in enumerate(parent):
        block[i + 1, i + 1] = True
        if p >= 0:
            block[i + 1] |= block[p + 1]
    return block


def tree_mask(parent: list[int], context: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive ``[1, 1, 1 + B, context + 1 + B]``: every row sees the context; within the tree,
    :func:`tree_visibility`."""
    block = tree_visibility(parent)
    seen = torch.cat([torch.ones(block.shape[0], context, dtype=torch.bool), block], dim=1)
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None].to(device)


def keep_tree_rows(cache, start: int, rows: torch.Tensor) -> None:
    """Keep the first ``start`` cached positions, then the tree rows ``rows`` (anchor and accepted
    path, in order), in every layer of a transformers ``DynamicCache``."""
    keep = torch.cat([torch.arange(start, device=rows.device), rows + start])
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(2, keep), layer.values.index_select(2, keep)


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (no embedding, no LM head: both are the target's).

    ``config.dflash_config`` holds ``block_size``, ``mask_token_id`` and ``target_layer_ids``;
    they are also attributes (``block_size``, ``mask_token_id``, ``target_layer_ids``), as z-lab's
    ``dflash_generate`` reads them.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash_draft"  # no attribute of that name: the checkpoint keys are used as they are
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        H = config.hidden_size
        self.target_layer_ids = [int(i) for i in _dflash_value(config, "target_layer_ids")]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, t) for t in types)
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """normal(0, initializer_range) Linear weights, unit RMSNorm weights; a weight transformers
        has loaded is never touched (:func:`_init_unless_loaded`)."""
        if isinstance(module, nn.Linear):
            std = self.config.initializer_range
            _init_unless_loaded(module.weight, lambda w: w.normal_(0.0, std))
        elif isinstance(module, DFlashRMSNorm):
            _init_unless_loaded(module.weight, lambda w: w.fill_(1.0))

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

    def compute_logits(self, hidden: torch.Tensor, output_head) -> torch.Tensor:
        """Draft logits ``[..., V]`` of hidden states ``[..., H]`` through the target's LM head
        ``output_head``, times ``output_multiplier`` and tanh-capped at ``final_logit_softcapping``
        when the config sets them (as z-lab's drafters do; 1.0 and none by default)."""
        logits = output_head(hidden) * float(_dflash_value(self.config, "output_multiplier", 1.0))
        cap = _dflash_value(self.config, "final_logit_softcapping")
        if cap is not None and float(cap) > 0:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, return_dict: bool | None = None,
                **kwargs):
        """Draft hidden states for one block per row.

        Args:
            target_hidden: ``[B, T, k*H]`` the target's hidden states of the context tokens at
                ``target_layer_ids``, concatenated on the last dim (with a cache: only the
                context tokens it does not hold yet; ``T`` may be 0).
            noise_embedding: ``[B, Q, H]`` the target's embeddings of the block tokens
                ``[anchor, mask, ..., mask]`` (``Q <= block_size``).
            position_ids: ``[B, T+Q]`` RoPE positions of these context then block tokens
                (default ``0..T+Q-1``: the anchor right after the context).
            attention_mask: bool ``[B, 1, Q, K]`` (True = attend; ``K`` = keys incl. cached ones),
                or None for :meth:`default_mask` (the same mask for every layer when given).
            past_key_values: a transformers ``Cache`` (e.g. ``DynamicCache(config=model.config)``)
                holding the keys/values of earlier context tokens; this call's are appended (crop
                it back to the context after the block, as z-lab's ``dflash_generate`` does).
                Cached keys are taken to sit at the positions right before this call's tokens.
            use_cache: accepted for z-lab's call; the cache is used whenever one is given.
            return_dict: True for a ``BaseModelOutput``; otherwise the tensor itself.

        Returns:
            ``[B, Q, H]`` post-norm hidden states (``.last_hidden_state`` of a ``BaseModelOutput``
            with ``return_dict=True``); slot ``j`` predicts token ``anchor + j`` through the
            target's LM head (:meth:`compute_logits`).
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
        cache = past_key_values

        def mask_for(layer_type: str):
            if attention_mask is not None:
                return attention_mask.bool()
            if cache is None:
                return self.default_mask(T, Q, position_ids, layer_type)

            def with_keys(K: int) -> torch.Tensor:  # cached keys: the positions just before this call's
                first = position_ids[:, T:T + 1] - (K - Q)
                kpos = first + torch.arange(K, device=position_ids.device)[None]
                return self.default_mask(K - Q, Q, kpos, layer_type)

            return with_keys

        masks: dict[str, object] = {}
        for i, layer in enumerate(self.layers):
            if layer.layer_type not in masks:
                masks[layer.layer_type] = mask_for(layer.layer_type)
            x = layer(x, ctx, rope_q, rope_k, masks[layer.layer_type], cache, i)
        out = self.output(x)
        return BaseModelOutput(last_hidden_state=out) if return_dict else out

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output ``[..., H]`` to the hidden states the LM head reads: ``norm``
        (a subclass in a file of its own may map them further before every reader)."""
        return self.norm(x)


    def _features(self, hidden_states) -> torch.Tensor:
        """``[1, T, k*H]``: transformers' ``hidden_states[i + 1]`` for each ``i`` in
        ``target_layer_ids``, concatenated (the public DFlash drafters' context features)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0, tree_budget: int = 0) -> torch.LongTensor:
        """Decode with ``target`` (a transformers causal LM this drafter was trained for), drafting
        ``block_size - 1`` tokens per target forward; the signature and return of z-lab's
        ``DFlashDraftModel.spec_generate``.

        Args:
            target: e.g. ``AutoModelForCausalLM.from_pretrained(...)``; its input embedding and LM
                head (``lm_head`` or ``get_output_embeddings()``) serve the drafter too.
            input_ids: ``[1, N]`` (long) prompt, on the target's device.
            max_new_tokens: at most this many tokens are added.
            stop_token_ids: decoding ends after the first of these it emits (kept), or None.
            temperature: 0 for greedy decoding: the output is then the target's own greedy text.
                Above 0, tokens are sampled from the target's ``softmax(logits / temperature)``
                (restricted by ``top_k`` then ``top_p``), drafts accepted by speculative sampling
                (:func:`_speculative_accept`), so the output has the target's distribution. A
                DFlash drafter draws its block from its own processed softmax; a DFlash2 drafter
                from its selector walk (:meth:`DFlash2DraftModel.select_sampled`: each slot one of
                its K candidates, ``q = softmax(score / temperature)`` given the slot before, no
                top-k/top-p), z-lab's DFlash2 sampled rule; an XPress drafter from the processed
                softmax of its last Jacobi pass's logits (:meth:`XPressDraftModel.refine`); either
                way ``q`` is what the block was drawn from, which is all the rejection rule needs
                to be lossless.
            top_p: nucleus mass in ``(0, 1]`` (sampling only).
            top_k: keep the ``top_k`` most likely tokens, 0 for all (sampling only).
            tree_budget: > 0: verify a tree of that many draft tokens per step instead of the
                chain: the block's most probable prefixes under the drafter's per-position
                marginals (its backbone's logits, for every variant), one target forward under a
                tree attention mask, the longest path the target agrees with kept. Greedy, the
                output is still the target's greedy text; sampled, each node's token is the
                target's own draw there, followed while a child carries it, so the output keeps
                the target's distribution. Needs a target that takes a 4-D attention mask and a
                ``DynamicCache`` with per-layer ``keys``/``values`` (transformers' Llama and
                Qwen3 models).

        Returns:
            ``[1, N + n]`` (long): the prompt then ``n <= max_new_tokens`` new tokens.

        Raises:
            ValueError: ``input_ids`` is not one non-empty row, the sampling settings are out of
                range (a non-finite or negative temperature, ``top_p`` outside (0, 1], ``top_k`` < 0),
                or ``tree_budget`` < 0.
        """
        _check_sampling(temperature, top_p, top_k)
        if tree_budget < 0:
            raise ValueError(f"tree_budget is the draft tokens per tree (0: the chain), got {tree_budget}")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"spec_generate decodes one non-empty sequence: input_ids must be [1, N] with "
                             f"N >= 1, got {list(input_ids.shape)}")
        self.eval()
        sampling = temperature > 0
        dev, N = input_ids.device, input_ids.shape[1]
        stops = set(stop_token_ids or ())
        emb_w = target.get_input_embeddings().weight
        emb_scale = float(_dflash_value(self.config, "input_embedding_scale", 1.0))
        head = _output_head(target)
        t_cache, d_cache = _new_cache(target.config), _new_cache(self.config)
        t_kw = {_cache_kwarg(target): t_cache, "use_cache": True, "output_hidden_states": True}

        def pick(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
            return _draw(_probs(logits, temperature, top_p, top_k)) if sampling else logits.argmax(-1)

        out = target(input_ids, position_ids=torch.arange(N, device=dev)[None], logits_to_keep=1, **t_kw)
        new = [int(pick(out.logits[0, -1]))]
        ctx = self._features(out.hidden_states)  # [1, T, k*H] context the drafter has not seen yet
        pos = N  # position of new[-1], the block's anchor (the target's cache holds 0..pos-1)
        while len(new) < max_new_tokens and new[-1] not in stops:
            Q = min(self.block_size, max_new_tokens - len(new) + 1)
            block = torch.full((1, Q), int(self.mask_token_id), dtype=torch.long, device=dev)
            block[0, 0] = new[-1]
            q = None
            if Q > 1:
                full = self(target_hidden=ctx, noise_embedding=F.embedding(block, emb_w) * emb_scale,
                            position_ids=torch.arange(pos - ctx.shape[1], pos + Q, device=dev)[None],
                            past_key_values=d_cache, use_cache=True)
                h = full[:, 1:]
                _crop(d_cache, pos)  # keep the context's keys/values, drop the block's
                logits = self.compute_logits(h, head)
                if tree_budget:
                    got, ctx = self._tree_step(target, t_kw, logits[0], new[-1], pos, tree_budget, pick)
                    got = got[: max_new_tokens - len(new)]
                    hit = next((j for j, t in enumerate(got) if t in stops), None)
                    got = got if hit is None else got[:hit + 1]
                    ctx = ctx[:, :len(got)]
                    pos += len(got)
                    _crop(t_cache, pos)
                    new += got
                    continue
                if hasattr(self, "refine"):  # XPress: Jacobi passes; sampled from the last pass's logits
                    before = torch.tensor([new[-2] if len(new) > 1 else int(input_ids[0, -1])], device=dev)
                    drafted, logits = self.refine(full, logits, before, block[:, 0])
                    if sampling:
                        q = _probs(logits[0], temperature, top_p, top_k)
                        block[0, 1:] = _draw(q)
                    else:
                        block[:, 1:] = drafted
                elif hasattr(self, "select") and sampling:  # DFlash2: q is the walk's, over K candidates
                    drafted, q = self.select_sampled(h, logits, block[:, 0], temperature)
                    block[:, 1:], q = drafted, q[0]
                elif hasattr(self, "select"):
                    block[:, 1:] = self.select(h, logits, anchor_ids=block[:, 0])
                elif sampling:
                    q = _probs(logits[0], temperature, top_p, top_k)  # [Q-1, V]
                    block[0, 1:] = _draw(q)
                else:
                    block[:, 1:] = logits.argmax(-1)
            out = target(block, position_ids=torch.arange(pos, pos + Q, device=dev)[None], **t_kw)
            if sampling:
                n, nxt = _speculative_accept(block[0, 1:], _probs(out.logits[0], temperature, top_p, top_k),
                                             q if q is not None else out.logits.new_zeros(0, 1))
            else:
                want = out.logits[0].argmax(-1)  # [Q] the target's token after each block token
                n = int((block[0, 1:] == want[:-1]).long().cumprod(0).sum())
                nxt = want[n]
            got = [*block[0, 1:n + 1].tolist(), int(nxt)][: max_new_tokens - len(new)]
            hit = next((j for j, t in enumerate(got) if t in stops), None)
            got = got if hit is None else got[:hit + 1]
            ctx = self._features(out.hidden_states)[:, :len(got)]  # anchor + accepted: now context
            pos += len(got)
            _crop(t_cache, pos)
            new += got
        tail = torch.tensor(new[:max_new_tokens], dtype=input_ids.dtype, device=dev)[None]
        return torch.cat([input_ids, tail], dim=1)

    def _tree_step(self, target: nn.Module, t_kw: dict, logits: torch.Tensor, anchor: int, pos: int,
                   budget: int, pick) -> tuple[list[int], torch.Tensor]:
        """One tree-verified step after the anchor token ``anchor`` at position ``pos``: the tree
        of ``logits [S, V]``, the target's forward over ``[anchor, nodes]``, the walk from the anchor
        (each row's next token by ``pick``, the child carrying it followed). Returns the accepted
        tokens then the target's next one, and the target's features ``[1, 1 + m, k*H]`` of the
        anchor and the accepted nodes; the target's cache keeps exactly those rows after ``pos``."""
        dev = logits.device
        nodes = _tree(logits, budget)
        parent = [p for p, _, _ in nodes]
        ids = torch.tensor([[anchor] + [t for _, _, t in nodes]], device=dev)
        positions = torch.tensor([[pos] + [pos + 1 + d for _, d, _ in nodes]], device=dev)
        mask = tree_mask(parent, pos, target.get_input_embeddings().weight.dtype, dev)
        out = target(ids, position_ids=positions, attention_mask=mask, **t_kw)
        path, row = [], 0                                            # row 0: the anchor
        while True:
            x = int(pick(out.logits[0, row]))                        # the target's token after this row
            child = next((i for i, p in enumerate(parent) if p == row - 1 and nodes[i][2] == x), None)
            if child is None:
                break
            path.append(child + 1)
            row = child + 1
        rows = torch.tensor([0] + path, device=dev)
        keep_tree_rows(t_kw[_cache_kwarg(target)], pos, rows)
        return [nodes[r - 1][2] for r in path] + [x], self._features(out.hidden_states)[:, rows]

__all__ = ["DFlashDraftModel"]


# -- DFlash2 (z-lab's DFlash2DraftModel layout): a grouped dynamic causal convolution around each
# sublayer and a candidate selector; the same math as dflash.model.dflash2 (tested against it).


class DFlash2Conv(nn.Module):
    """``K``-tap causal convolution over the block tokens: ``y[t, c] = sum_o (base_kernel[s, o, c]
    + dyn[t, s, o, c // group_size]) * v[t - o, c]`` (zeros before the block's first token), with
    ``dyn = kernel_projection(normed sublayer input)`` and side ``s`` 0 before the sublayer, 1 after."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # the identity until weights are loaded

    def coefficients(self, normed: torch.Tensor) -> torch.Tensor:
        return self.kernel_projection(normed).unflatten(-1, (2, self.kernel_size, self.groups))

    def forward(self, v: torch.Tensor, coef: torch.Tensor, side: int) -> torch.Tensor:
        B, Q, H = v.shape
        v4 = v.reshape(B, Q, self.groups, self.group_size)
        base = self.base_kernel[side].to(v.dtype).view(self.kernel_size, self.groups, self.group_size)
        out = torch.zeros_like(v4)
        for o in range(min(self.kernel_size, Q)):
            shifted = F.pad(v4[:, : Q - o], (0, 0, 0, 0, o, 0))
            out = out + shifted * (base[o] + coef[:, :, side, o, :, None])
        return out.reshape(B, Q, H)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with ``attention_conv`` and ``mlp_conv`` around its two sublayers."""

    def __init__(self, c: Qwen3Config, layer_type: str) -> None:
        super().__init__(c, layer_type)
        k, g = int(_dflash_value(c, "conv_kernel_size")), int(_dflash_value(c, "conv_group_size"))
        self.attention_conv = DFlash2Conv(c.hidden_size, k, g)
        self.mlp_conv = DFlash2Conv(c.hidden_size, k, g)

    def forward(self, x, ctx, rope_q, rope_k, mask, cache=None, layer_idx: int = 0) -> torch.Tensor:
        u = self.input_layernorm(x)
        c = self.attention_conv.coefficients(u)
        a = self.self_attn(self.attention_conv(u, c, 0), ctx, rope_q, rope_k, mask, cache, layer_idx)
        x = x + self.attention_conv(a, c, 1)
        u = self.post_attention_layernorm(x)
        c = self.mlp_conv.coefficients(u)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(u, c, 0)), c, 1)


class DFlash2Selector(nn.Module):
    """Re-ranks the drafter's top-K tokens per block position by a low-rank bigram term:
    ``score[k] = logit[c_k] + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c_k]>``."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))  # bare, as published
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
             temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Walk the block left to right from the anchor, each position's choice the predecessor
        of the next (z-lab's ``CandidateSelector.select``).

        Args:
            hidden: ``[B, L, H]`` post-norm hidden states of the drafted positions.
            logits: ``[B, L, V]`` their logits (:meth:`DFlashDraftModel.compute_logits`).
            anchor_ids: ``[B]`` (long) the last committed token.
            temperature: <= 0: each position takes its best-scoring candidate (greedy). > 0: it
                draws one of its K candidates from ``softmax(score / temperature)`` (torch's global
                generator), the score given the token drawn for the position before.

        Returns:
            ``(ids [B, L] long, q [B, L, V] fp32 or None when greedy)``: row ``[b, j]`` of ``q`` is
            the distribution position ``j`` was drawn from, zero off its K candidates (what
            speculative sampling divides by: :func:`_speculative_accept`).
        """
        unary, cand = torch.topk(logits.float(), self.top_k, dim=-1)  # [B, L, K], distinct ids
        gate = self.hidden_projection(hidden)
        prev, out, qs = anchor_ids, [], []
        for j in range(cand.shape[1]):
            ctx = (self.predecessor_codebook[prev] * gate[:, j]).to(self.successor_codebook.dtype)
            pair = torch.matmul(self.successor_codebook[cand[:, j]], ctx.unsqueeze(-1)).squeeze(-1)
            score = unary[:, j] + pair.float()                           # [B, K]
            if temperature > 0:
                q = torch.softmax(score / temperature, dim=-1)
                idx = torch.multinomial(q, 1)
                qs.append(torch.zeros_like(logits[:, j], dtype=torch.float32).scatter_(-1, cand[:, j], q))
            else:
                idx = score.argmax(-1, keepdim=True)
            prev = cand[:, j].gather(1, idx)[:, 0]
            out.append(prev)
        return torch.stack(out, 1), (torch.stack(qs, 1) if qs else None)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Greedy walk: ``hidden [B, L, H]`` and ``logits [B, L, V]`` of the drafted positions,
        ``anchor_ids [B]`` (the last committed token) -> ``[B, L]`` drafted ids (:meth:`walk`)."""
        return self.walk(hidden, logits, anchor_ids)[0]


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter: :class:`DFlashDraftModel` (its forward, cache, attributes and
    ``compute_logits``) with the convolutions in every layer and ``candidate_selector``.

    ``config.dflash_config`` also holds ``conv_kernel_size``, ``conv_group_size``,
    ``selector_top_k`` and ``selector_rank``. The convolutions run over the ``noise_embedding``
    tokens of a call (one block). :meth:`select` drafts the block's tokens from its output::

        h = drafter(target_hidden=feats, noise_embedding=block_emb)[:, 1:]
        draft = drafter.select(h, drafter.compute_logits(h, target.lm_head), anchor_ids=block_ids[:, 0])

    :meth:`select_sampled` draws the block instead (at a temperature) and returns the ``q`` it drew
    from, for speculative sampling (:meth:`spec_generate` with ``temperature > 0``).
    """

    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        types = [layer.layer_type for layer in self.layers]
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config, t) for t in types)
        self.candidate_selector = DFlash2Selector(config.vocab_size, config.hidden_size,
                                                  int(_dflash_value(config, "selector_rank")),
                                                  int(_dflash_value(config, "selector_top_k")))
        self.post_init()

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The drafted tokens ``[B, L]`` of positions whose post-norm states are ``hidden [B, L, H]``
        and logits ``logits [B, L, V]`` (:meth:`compute_logits`), after ``anchor_ids [B]``."""
        return self.candidate_selector(hidden, logits, anchor_ids)

    def select_sampled(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select` sampled at ``temperature > 0`` (z-lab's DFlash2 sampled rule): each
        position's token drawn from ``softmax(score / temperature)`` over its K candidates. Returns
        ``(ids [B, L] long, q [B, L, V] fp32)``, ``q`` the distributions drawn from (zero off the
        candidates; :meth:`DFlash2Selector.walk`)."""
        if not temperature > 0:
            raise ValueError(f"select_sampled needs temperature > 0, got {temperature}: use select() for greedy")
        return self.candidate_selector.walk(hidden, logits, anchor_ids, temperature)


__all__.append("DFlash2DraftModel")


# -- XPress (the layout vLLM speculators 0.9 loads as ``refiner_head``): a causal low-rank refiner
# resolved by parallel Jacobi passes; the same math as dflash.model.xpress (tested against it).


class XPressRefinerHead(nn.Module):
    """Per-slot logit correction from the token before each slot (XPress, arXiv 2608.02438):
    ``a = in_proj([down_h(h) ; down_g(mean h) ; token_embed(prev)])``, a causal per-channel mix
    over the block (``mix_l``, lower-triangular), a SwiGLU residual, then ``readout``."""

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int, mlp_ratio: int) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``[B, b, V]`` for ``hidden [B, b, H]`` (every block slot, the anchor's first) and the
        slots' predecessors ``prev [B, b]`` (long)."""
        b = prev.shape[1]
        h = hidden.to(self.down_h.weight.dtype)
        ctx = torch.cat([self.down_h(h), self.down_g(h.mean(1, keepdim=True).expand_as(h))], dim=-1)
        a = self.in_proj(torch.cat([ctx, self.token_embed(prev).to(ctx.dtype)], dim=-1))
        mix = self.mix_l[:, :b, :b] * torch.ones(b, b, dtype=torch.bool, device=a.device).tril()
        a = a + torch.einsum("cji,nic->njc", mix.to(a.dtype), a)
        a = a + self.mlp_down(F.silu(self.mlp_gate(a)) * self.mlp_up(a))
        return self.readout(a)


class XPressDraftModel(DFlashDraftModel):
    """The XPress drafter: :class:`DFlashDraftModel` with ``refiner_head``.

    ``config.dflash_config`` also holds ``xpress_rank``, ``xpress_mlp_ratio`` and
    ``num_jacobi_passes``. :meth:`refine` drafts the block from the full forward output::

        h = drafter(target_hidden=feats, noise_embedding=block_emb)          # [B, b, H], slot 0 the anchor
        logits = drafter.compute_logits(h[:, 1:], target.lm_head)
        draft, refined = drafter.refine(h, logits, before_anchor, anchor_ids)
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.num_jacobi_passes = int(_dflash_value(config, "num_jacobi_passes", 6))
        self.refiner_head = XPressRefinerHead(config.vocab_size, config.hidden_size, self.block_size,
                                              int(_dflash_value(config, "xpress_rank", 256)),
                                              int(_dflash_value(config, "xpress_mlp_ratio", 2)))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.Embedding):
            std = self.config.initializer_range
            _init_unless_loaded(module.weight, lambda w: w.normal_(0.0, std))
        elif isinstance(module, XPressRefinerHead):
            _init_unless_loaded(module.mix_l, lambda w: w.zero_())

    @torch.no_grad()
    def refine(self, hidden: torch.Tensor, logits: torch.Tensor, before_anchor: torch.Tensor,
               anchor_ids: torch.Tensor, passes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy Jacobi passes over the block: each pass re-reads every slot's predecessor from the
        previous pass's argmax (the first from ``logits``'), stopping at a fixed point.

        Args:
            hidden: ``[B, b, H]`` every slot's post-norm state. logits: ``[B, b-1, V]`` slots 1..b-1.
            before_anchor, anchor_ids: ``[B]`` (long) the token before the anchor, and the anchor.
            passes: at most this many (default ``num_jacobi_passes``).

        Returns:
            ``(ids [B, b-1] long, refined logits [B, b-1, V])``.
        """
        refined, draft = logits, logits.argmax(-1)
        for _ in range(self.num_jacobi_passes if passes is None else passes):
            prev = torch.cat([before_anchor[:, None], anchor_ids[:, None], draft[:, :-1]], dim=1)
            refined = logits + self.refiner_head.bias(hidden, prev)[:, 1:].to(logits.dtype)
            new = refined.argmax(-1)
            if torch.equal(new, draft):
                break
            draft = new
        return draft, refined


__all__.append("XPressDraftModel")
