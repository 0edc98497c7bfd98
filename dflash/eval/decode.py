"""Decoding with a target: plain greedy, and draft-and-verify with a drafter proposing blocks.

One step of speculative decoding (DFlash; speculative decoding, Leviathan et al. 2023, Chen et
al. 2023):

1. The last accepted token is the anchor; its target features are not known yet. The drafter
   sees the features of every earlier token and proposes ``bs - 1`` tokens for the block
   ``[anchor, mask, ..., mask]`` in one forward.
2. The target runs over ``[anchor, d_1 .. d_{bs-1}]`` with its KV cache: ``g_i`` (greedy: its
   argmax; sampled: its distribution ``p_i``) is for the position after block slot ``i``.
3. Greedy: accept ``m`` = the longest prefix with ``d_i == g_{i-1}``, then the bonus token
   ``g_m``. Sampled (``temperature > 0``): accept ``d_i`` with probability
   ``min(1, p_{i-1}(d_i) / q_i(d_i))`` while they are accepted; at the first rejection sample
   from ``norm(max(p - q, 0))``, after ``bs - 1`` acceptances the bonus from ``p_{bs-1}``; ``p``
   and ``q`` are the target's and the drafter's distributions after the same processing
   (:func:`sampling_probs`), or ``q`` is a proposer's own (DFlash2: the selector walk's softmax
   over its K candidates, row ``i`` given the drafts before it). The output is distributed
   exactly as the target's own processed sampling whatever ``q`` is, as long as the drafts are
   drawn from it (the rejection-sampling theorem of both papers; chi-square tests check it).
4. The target's features of the anchor and the ``m`` accepted drafts join the context, its cache
   is cropped to the accepted tokens. Greedy output equals plain greedy decoding (tested).

``m`` is the *accepted length* of the step (bonus not counted); the step produces ``tau = m + 1``
tokens, the figure z-lab's reference decoder and SGLang report (:mod:`dflash.train.acceptance`).
Near the end of a generation only as many tokens are drafted as remain
(``min(bs - 1, remaining)``), and the output is cut to exactly ``max_new_tokens``.

Speed (batch 1 is launch-bound at small targets): tokens and features live in buffers allocated
once per generation (no ``torch.cat`` growth), positions are slices of one ``arange``, the
KV-cache keyword is looked up once, greedy decoding reads nothing back to the host (the next
input is a slice of the device buffer), and a verify step reads one integer (``m``) back. With
``cuda_graphs=True`` a Llama or Qwen3 target runs each step at a fixed shape over a static KV cache,
replayed as one CUDA graph on a GPU (:mod:`dflash.eval.static_target`; same outputs, tested on CPU,
where the same forward runs eagerly); another target keeps the dynamic cache, with one log line.

Proposers: :class:`DrafterProposer` (recomputes the drafter's context each step),
:class:`CachedDrafterProposer` (a drafter KV cache; same drafts), :class:`OracleProposer` (the
target's own continuation: every draft accepted). A proposer that also has ``logits`` (the two
drafter proposers: ``q`` is :func:`sampling_probs` of them) or ``sample`` (its own draft
distribution, e.g. a DFlash2 selector walk's over its K candidates, :mod:`dflash.eval.selector`)
can be used with ``temperature > 0``. Used by ``python -m dflash.eval`` (:mod:`dflash.eval.measure`)
and ``benchmarks/decode/speed.py``.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from collections.abc import Callable

import torch

from dflash.eval.proposers import (
    CachedDrafterProposer,
    DrafterContextCache,
    DrafterProposer,
    Proposer,
    SamplingProposer,
)
from dflash.eval.static_target import StaticTarget, UnsupportedTarget, acquire, release
from dflash.model.target import Target

# the drafter proposers are re-exported: a decode is always called with one
__all__ = ["CachedDrafterProposer", "CachedTarget", "DecodeStopped", "DrafterContextCache", "DrafterProposer",
           "OracleProposer", "Proposer", "SamplingProposer", "crop_cache", "greedy_decode", "sampling_probs",
           "speculative_decode"]


class DecodeStopped(Exception):
    """A decode's ``should_stop()`` returned True: it ended before its last token (nothing returned)."""

log = logging.getLogger(__name__)


class OracleProposer:
    """Proposes the target's own greedy continuation (an upper bound: every draft is accepted)."""

    def __init__(self, target: Target, block_size: int) -> None:
        self.target, self.bs = target, block_size

    @torch.no_grad()
    def propose(self, tokens, features):
        return greedy_decode(self.target, tokens, self.bs - 1)[tokens.shape[0]:]


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """The processed sampling distribution ``[.., V]`` fp32 of ``logits [.., V]``.

    In transformers' ``generate`` order: divide by ``temperature``, keep the ``top_k`` largest
    (0 = all; ties with the k-th are kept, as ``TopKLogitsWarper``), then the smallest set of
    most likely tokens whose mass reaches ``top_p`` (1 = all; the most likely token is always
    kept), renormalised. Draft and target distributions of :func:`speculative_decode` both come
    from here, which is what makes the rejection rule lossless for the processed target.
    """
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p     # mass before it already reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _check_inputs(prompt: torch.Tensor, temperature: float, top_p: float, top_k: int) -> None:
    """One ValueError for a prompt or sampling setting no decode can honour."""
    if prompt.dim() != 1 or prompt.shape[0] == 0:
        raise ValueError(f"a prompt is a non-empty [n] tensor of token ids; got shape {list(prompt.shape)}")
    if not (math.isfinite(temperature) and temperature >= 0) or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sampling needs a finite temperature >= 0 (0: greedy), 0 < top_p <= 1 and an integer "
                         f"top_k >= 0 (0: all); got temperature={temperature}, top_p={top_p}, top_k={top_k}")


def _accept_sampled(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """Speculative rejection sampling of one verify step (Leviathan et al. 2023, Algorithm 1;
    Chen et al. 2023). ``draft [d]`` sampled from ``q [d, V]``; ``p [d+1, V]`` the target's.

    Returns ``(m, token)``: ``m`` drafts accepted (each with probability ``min(1, p/q)`` while all
    before it were), and the next token (0-dim, on the device): from ``norm(max(p_m - q_m, 0))``
    after a rejection, from ``p_d`` after ``d`` acceptances. All rows' candidates are drawn
    before ``m`` is read, so the step reads the host once.
    """
    d = draft.shape[0]
    u = torch.rand(d, device=p.device, generator=generator)
    pd = p[:d].gather(1, draft[:, None])[:, 0]
    qd = q.gather(1, draft[:, None])[:, 0]
    ok = (u * qd < pd).long().cumprod(0)                                     # u < p/q, q > 0
    residual = torch.cat([(p[:d] - q).clamp_min(0.0), p[d:]])                # [d+1, V]
    total = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass; that row is then never reached (acceptance probability 1)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), p)
    cand = torch.multinomial(residual, 1, generator=generator)[:, 0]        # [d+1]
    m = int(ok.sum())
    return m, cand[m]


def _cache_kwarg(target: Target) -> str:
    """The KV-cache keyword of the base model's forward (``cache`` in newer transformers 5.x)."""
    params = inspect.signature(target.model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(target: Target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.hf_config)
    except TypeError:
        return DynamicCache()


def crop_cache(cache, keep: int) -> None:
    """Keep the first ``keep`` cached tokens. A negative ``crop`` argument means "remove that
    many" in every transformers 5.x; 0 must be skipped (older 5.x read it as "keep 0")."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


class CachedTarget:
    """The target with its KV cache for one generation of at most ``capacity`` positions."""

    def __init__(self, target: Target, capacity: int) -> None:
        self.target = target
        self.base = target.model.model
        self.lm_head = target.model.get_output_embeddings()
        self.kwargs = {_cache_kwarg(target): _new_cache(target), "use_cache": True}
        self.cache = self.kwargs[_cache_kwarg(target)]
        self.positions = torch.arange(capacity, device=target.device)[None]  # sliced, never rebuilt

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, start: int, features: bool = True, last_only: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Cached forward of ``ids [n]`` at positions ``start..``: ``(features [1, n, k*H] or None,
        logits [n or 1, V])`` (logits only for these positions, or the last one)."""
        n = ids.shape[0]
        out = self.base(input_ids=ids[None], position_ids=self.positions[:, start:start + n],
                        **self.kwargs)
        hidden = out.last_hidden_state[0, -1:] if last_only else out.last_hidden_state[0]
        # the hooks captured the layers either way; greedy decoding does not need their concat
        return (self.target.collect() if features else None), self.lm_head(hidden)

    def keep(self, n: int) -> None:
        """Keep the first ``n`` cached positions (a rejected draft's are dropped)."""
        crop_cache(self.cache, n)


_TOLD: weakref.WeakSet = weakref.WeakSet()  # targets whose static-verify refusal was logged once


def _target_run(target: Target, width: int, capacity: int, cuda_graphs: bool) -> CachedTarget | StaticTarget:
    """The target's cached forward for one generation: a pooled :class:`StaticTarget` of ``width``
    tokens per step with ``cuda_graphs`` (CUDA-graph replays on a GPU), else :class:`CachedTarget`,
    which is also the fallback for a target the static path does not run (logged once per target).
    Hand a static one back with :func:`dflash.eval.static_target.release` after the generation."""
    if not cuda_graphs:
        return CachedTarget(target, capacity)
    return static_or_cached(target, lambda: acquire(target, width, capacity), capacity)


def static_or_cached(target: Target, make_static: Callable[[], object], capacity: int):
    """``make_static()`` (a fixed-shape step for CUDA graphs), or, for a target the static path does
    not run (:class:`~dflash.eval.static_target.UnsupportedTarget`), a :class:`CachedTarget` of
    ``capacity`` positions, the refusal logged once per target."""
    try:
        return make_static()
    except UnsupportedTarget as exc:
        if target not in _TOLD:
            _TOLD.add(target)
            log.warning("dflash.eval: no CUDA graphs for this target (%s); decoding with the dynamic "
                        "KV cache", exc)
    return CachedTarget(target, capacity)


@torch.no_grad()
def greedy_decode(target: Target, prompt: torch.Tensor, max_new_tokens: int, *,
                  cuda_graphs: bool = False) -> torch.Tensor:
    """Plain greedy decoding with a KV cache: ``prompt [n]`` (int64) -> ``[n + max_new_tokens]``.

    No host read per token: each argmax is written to a device buffer and the next step reads its
    slice, so on a GPU the host queues steps ahead of the kernels. ``cuda_graphs``: each token's
    step is a static-shape forward, a CUDA-graph replay on a GPU (module docstring).

    Raises:
        ValueError: an empty prompt.
    """
    _check_inputs(prompt, 0.0, 1.0, 0)
    n = prompt.shape[0]
    run = _target_run(target, 1, n + max_new_tokens, cuda_graphs)
    try:
        out = torch.empty(n + max_new_tokens, dtype=torch.long, device=prompt.device)
        out[:n] = prompt
        _, logits = run(prompt, 0, features=False, last_only=True)
        out[n] = logits[0].argmax()
        for i in range(n, n + max_new_tokens - 1):
            _, logits = run(out[i:i + 1], i, features=False)
            out[i + 1] = logits[0].argmax()
        return out
    finally:
        if isinstance(run, StaticTarget):  # however it ends (a stopped decode too)
            release(run)


@torch.no_grad()
def speculative_decode(target: Target, proposer: Proposer, prompt: torch.Tensor,
                       max_new_tokens: int, block_size: int, *, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0,
                       generator: torch.Generator | None = None, cuda_graphs: bool = False,
                       should_stop: Callable[[], bool] | None = None
                       ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Draft-and-verify decoding (module docstring): greedy at ``temperature == 0``, else lossless
    speculative rejection sampling of the target processed by :func:`sampling_probs`.

    Args:
        prompt: ``[n]`` int64 on the target's device.
        temperature, top_p, top_k: as :func:`sampling_probs`; ``temperature > 0`` needs a
            proposer with ``sample`` (:class:`SamplingProposer`: the drafts and their ``q``, used
            as given) or ``logits(tokens, features) -> [bs-1, V]`` (the drafter proposers:
            ``q = sampling_probs(logits)``). ``p`` is the processed target either way.
        generator: the random source of every sample and acceptance draw (on the target's
            device; None = torch's default generator).
        cuda_graphs: verify with the static-shape target step, one CUDA-graph replay per step on a
            GPU (module docstring); False: transformers' forward with a dynamic KV cache.
        should_stop: asked before each verify step (a cheap flag read, e.g. a run's stop request);
            True ends the decode with :class:`DecodeStopped`. A long decode then stops within one
            step instead of running to ``max_new_tokens``.

    Returns:
        ``(tokens [n + max_new_tokens], accepted m per step, anchor index per step)``: the last
        step drafts only as many tokens as remain; a bonus token past the end is dropped.

    Raises:
        ValueError: an empty prompt, bad sampling parameters (a non-finite or negative temperature,
            ``top_p`` outside (0, 1], ``top_k`` < 0), or ``temperature > 0`` with a proposer that has
            neither ``sample`` nor ``logits``.
        DecodeStopped: ``should_stop()`` returned True.
    """
    _check_inputs(prompt, temperature, top_p, top_k)
    sampled = temperature > 0
    own_q = sampled and hasattr(proposer, "sample")
    if sampled and not own_q and not hasattr(proposer, "logits"):
        raise ValueError(f"{type(proposer).__name__} has no logits() or sample(): sampled decoding needs "
                         "the drafter's distribution (use a drafter proposer or selector_proposer)")
    n0 = prompt.shape[0]
    end = n0 + max_new_tokens
    capacity = end + block_size                   # room for the last step's drafts past the end
    run = _target_run(target, block_size, capacity, cuda_graphs)
    try:
        tokens = torch.empty(capacity, dtype=torch.long, device=prompt.device)
        tokens[:n0] = prompt
        f, logits = run(prompt, 0, last_only=True)                               # prefill
        feats = torch.empty(1, capacity, f.shape[-1], dtype=f.dtype, device=f.device)
        feats[:, :n0] = f
        if sampled:
            p = sampling_probs(logits, temperature, top_p, top_k)
            tokens[n0] = torch.multinomial(p, 1, generator=generator)[0, 0]
        else:
            tokens[n0] = logits[0].argmax()
        n = n0 + 1                                     # tokens known; tokens[n-1] is the anchor
        accepted, anchors = [], []
        while n < end:
            if should_stop is not None and should_stop():
                raise DecodeStopped(f"stopped after {len(accepted)} verify steps")
            d = min(block_size - 1, end - n)                                     # drafts this step
            if own_q:  # the proposer draws the block itself (a selector walk: q_j given drafts < j)
                draft, q = proposer.sample(tokens[:n], feats[:, :n - 1], temperature, generator)
                draft, q = draft[:d], q[:d]                                      # [d], [d, V]
            elif sampled:
                q = sampling_probs(proposer.logits(tokens[:n], feats[:, :n - 1])[:d],
                                   temperature, top_p, top_k)                    # [d, V]
                draft = torch.multinomial(q, 1, generator=generator)[:, 0]
            else:
                draft = proposer.propose(tokens[:n], feats[:, :n - 1])[:d]       # [d]
            tokens[n:n + d] = draft
            f, logits = run(tokens[n - 1:n + d], n - 1)                          # [1, d+1, k*H], [d+1, V]
            feats[:, n - 1:n + d] = f          # slots past the accepted ones are overwritten later
            if sampled:
                m, nxt = _accept_sampled(draft, sampling_probs(logits, temperature, top_p, top_k), q,
                                         generator)
            else:
                g = logits.argmax(-1)                                            # [d+1]
                m = int((draft == g[:d]).long().cumprod(0).sum())                # the one host read
                nxt = g[m]
            tokens[n + m] = nxt                # tokens[n:n+m] already hold the accepted drafts
            run.keep(n + m)
            accepted.append(m)
            anchors.append(n - 1)
            n += m + 1
        return tokens[:end], accepted, anchors
    finally:
        if isinstance(run, StaticTarget):  # however it ends (DecodeStopped too): the next decode reuses it
            release(run)
