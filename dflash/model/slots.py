"""Many answers at once over a fixed batch of slots: the ``"slots"`` engine of :mod:`dflash.model.answers`.

Measured on an H100 with SmolLM2-135M-Instruct, transformers' ``generate`` over left-padded batches
of 512 spends about 59 ms per decode step (``benchmarks/results/LOG.md``, "SmolLM2-135M-Instruct a
third time"): the padding mask sends SDPA to a kernel that needs the key/value heads repeated to the
query heads' count on every step of every layer, the cache grows by concatenation, and each of the
~1,000 ops of a step is launched from Python. This engine decodes the same target, same weights
and the same arithmetic per token, as a serving engine does:

* ``B`` slots share one KV cache ``k, v [layers, B, kv_heads, capacity, head_dim]`` allocated once;
  slot ``i`` of a row holds that row's position ``i``, and each row attends to its slots ``<=`` its
  own position, so rows of any lengths decode side by side with no padding and no cropping.
* the decode step (one token for every row) has fixed shapes and no host reads, so on CUDA it is
  captured once and replayed as a CUDA graph (:class:`dflash.model.cuda_graph.GraphedStep`); the
  query heads of one key head are packed into the query length, so SDPA sees equal head counts
  (as transformers' ``pack_gqa``) and no key/value is repeated;
* when a row's answer ends (an end token, or ``max_new_tokens``) its slot takes the next context:
  that context is prefilled eagerly (a causal forward of its tokens, written into the slot's cache)
  while the other rows keep their state. The host looks at the rows every ``check_every`` steps (one
  device-to-host copy), so a finished row rides along at most that many steps.

Greedy answers are the target's argmax at every step, token-identical to ``generate``'s in fp32 on a
CPU (tested); in bf16 on a GPU the kernels sum in another order and a tie to rounding may part two
engines' answers, as between any two batch sizes. Sampled answers draw from the target's softmax
at ``temperature``, restricted to the top-``top_p`` nucleus (the smallest set of most probable tokens
whose probability reaches ``top_p``; Holtzman et al., 2020, "The Curious Case of Neural Text
Degeneration"), by the exponential race (``argmax p / E``, ``E ~ Exp(1)``), which is a categorical
draw and runs inside the graph.

Supported targets are those :mod:`dflash.eval.static_target` also re-runs op by op: Llama and Qwen3
families, full attention, fixed rotary frequencies (:func:`check_model`).
"""

from __future__ import annotations

from collections import deque
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from dflash.model.cuda_graph import GraphedStep
from dflash.model.drafter import apply_rope
from dflash.model.target import FIXED_ROPE
from dflash.model.target import FIXED_SHAPE_FAMILIES as FAMILIES
from dflash.repetition import HASH_BASE, NGRAM, loop_start

__all__ = ["CHECK_EVERY", "MOST_ROWS", "PREFILL_TOKENS", "USE_GENERATE", "SlotDecoder", "check_model", "choose",
           "decode", "kv_bytes_per_row", "loop_starts", "positions_for", "rows_that_fit"]

CHECK_EVERY = 16
"""Decode steps between two looks at the rows (one host sync each); a finished row idles at most
this many steps before its slot is refilled, and the rows freed meanwhile are prefilled together."""
PREFILL_TOKENS = 65536
"""Context tokens per eager prefill forward (rows x their longest context): bounds its activations."""
USE_GENERATE = "; use --engine generate"
"""The advice that ends :func:`check_model`'s refusals (``--engine auto`` drops it: it switches itself)."""
MOST_ROWS = 512
"""The most rows :func:`rows_that_fit` gives: the batch measured on an H100 with SmolLM2-135M-Instruct
(32.5K answer tokens/s, 4.3x ``generate``; ``benchmarks/results/LOG.md``, "a fourth time"). Past it a
step of a small target is bound by its per-row work rather than its launches, and a larger cache only
delays the first chunk."""
KV_SHARE = 0.5
"""The share of the GPU's free memory :func:`rows_that_fit` gives the KV cache; the rest is left for
the eager prefill's activations (up to :data:`PREFILL_TOKENS` tokens), the step's logits and another
process on the same GPU (two regeneration passes run side by side)."""


def kv_bytes_per_row(model, positions: int) -> int:
    """Bytes of one row's keys and values over ``positions`` cache slots in every layer, in the
    target's dtype: ``2 x layers x kv_heads x positions x head_dim x itemsize``."""
    hf, w = model.config, model.get_input_embeddings().weight
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return 2 * hf.num_hidden_layers * hf.num_key_value_heads * positions * head_dim * w.element_size()


def rows_that_fit(model, positions: int, free_bytes: int, share: float = KV_SHARE, most: int = MOST_ROWS) -> int:
    """Rows whose KV cache of ``positions`` slots fits in ``share`` of ``free_bytes``: at least 1 (a
    GPU too full for one row then fails in the allocation, with its own message), at most ``most``.
    E.g. SmolLM2-135M-Instruct in bf16 (30 layers, 3 KV heads of 64) holds 22.5 KiB per slot and
    row, so 1,088 slots (768 context + 256 answer tokens) take 25 MB a row and 512 rows 12.8 GB;
    Qwen3-8B (36 layers, 8 KV heads of 128) takes 160 MB a row: about 190 rows in half of an H100's
    62 GB left free by its weights."""
    return max(1, min(most, int(share * free_bytes) // kv_bytes_per_row(model, positions)))


def positions_for(longest_context: int, max_new_tokens: int, check_every: int = CHECK_EVERY) -> int:
    """Cache slots per row: the longest context, the answer and a check's idle steps, rounded up to 64."""
    return -(-(longest_context + max_new_tokens + check_every + 1) // 64) * 64


def check_model(model) -> None:
    """Refuse a target this engine does not reproduce.

    Raises:
        ValueError: one line naming what is unsupported (model type, sliding-window layers, a
            rotary type that recomputes its frequencies) and what to use instead.
    """
    hf = model.config
    kind = getattr(hf, "model_type", None)
    hint = USE_GENERATE
    if kind not in FAMILIES:
        raise ValueError(f"the slots engine runs {' and '.join(FAMILIES)} targets; this one is {kind!r}{hint}")
    types = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise ValueError(f"the slots engine runs full-attention layers only; this target has {sorted(types)}{hint}")
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in FIXED_ROPE:
        raise ValueError(f"the slots engine needs fixed rotary frequencies; rope_type {rope!r} recomputes "
                         f"them per forward{hint}")


def choose(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The next token of each row, ``[n]`` int64, from ``logits [n, V]``: the argmax when
    ``temperature <= 0``, else one draw from ``softmax(logits / temperature)`` within the top-``top_p``
    nucleus (module docstring). No host reads: it runs inside a captured step."""
    if temperature <= 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_p < 1.0:
        top, order = scores.sort(-1, descending=True)
        probs = top.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p        # the more probable tokens already reach top_p
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, top.masked_fill(outside, float("-inf")))
    race = scores.softmax(-1) / torch.empty_like(scores).exponential_()
    return race.argmax(-1)


class SlotDecoder:
    """``B`` rows decoding side by side over one static KV cache (module docstring).

    Args:
        model: a Llama or Qwen3 causal LM from transformers, in eval mode (:func:`check_model`).
        batch: ``B``, rows decoded at once.
        capacity: cache positions per row: at least the longest context + ``max_new_tokens`` +
            ``check_every``.
        max_new_tokens: answer tokens per row at most.
        temperature: 0 = greedy; otherwise sampled at this temperature within ``top_p``.
        top_p: nucleus mass kept when sampling (1 = the whole vocabulary).
        graphs: capture the decode step as a CUDA graph (CUDA only; a CPU runs it eagerly).
        check_every: decode steps between two looks at the rows.
    """

    def __init__(self, model, batch: int, capacity: int, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, graphs: bool = True, check_every: int = CHECK_EVERY) -> None:
        check_model(model)
        hf, base = model.config, model.model
        self.base, self.lm_head, self.layers = base, model.get_output_embeddings(), list(base.layers)
        a = self.layers[0].self_attn
        self.head_dim, self.heads, self.kv_heads = a.head_dim, hf.num_attention_heads, hf.num_key_value_heads
        self.batch, self.capacity, self.check_every = batch, capacity, check_every
        self.temperature, self.top_p = temperature, top_p
        self.width = max_new_tokens + check_every + 1          # answer tokens a row may hold
        dev, dtype = base.embed_tokens.weight.device, base.embed_tokens.weight.dtype
        shape = (len(self.layers), batch, self.kv_heads, capacity, self.head_dim)
        self.k = torch.zeros(shape, device=dev, dtype=dtype)   # zeros: a masked slot is never NaN
        self.v = torch.zeros(shape, device=dev, dtype=dtype)
        self.slots = torch.arange(capacity, device=dev)
        self.rows = torch.arange(batch, device=dev)
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)     # each row's last token
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)     # ... and its position
        self.count = torch.zeros(batch, dtype=torch.long, device=dev)   # answer tokens so far
        self.answers = torch.zeros(batch, self.width, dtype=torch.long, device=dev)
        self.step = GraphedStep(self._step, graphs, dev.type == "cuda", f"the {batch}-row answer step")

    def _attend(self, layer, x: torch.Tensor, pos: torch.Tensor):
        """``q [n, heads, w, d]``, ``k, v [n, kv_heads, w, d]`` of ``x [n, w, H]`` at positions ``pos [n, w]``."""
        a, (n, w, _), d = layer.self_attn, x.shape, self.head_dim
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(n, w, self.heads, d)
        k = a.k_proj(h).view(n, w, self.kv_heads, d)
        if hasattr(a, "q_norm"):                                        # Qwen3: per-head RMSNorm
            q, k = a.q_norm(q), a.k_norm(k)
        cos, sin = self.base.rotary_emb(x, pos)
        cos, sin = cos[:, None], sin[:, None]
        v = a.v_proj(h).view(n, w, self.kv_heads, d).transpose(1, 2)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def _step(self) -> torch.Tensor:
        """One token for every row, no host reads: writes each row's key/value at its position and
        its next token at ``answers[row, count]``; returns the next tokens ``[B]``."""
        n, d, g = self.batch, self.head_dim, self.heads // self.kv_heads
        x = self.base.embed_tokens(self.ids[:, None])                   # [B, 1, H]
        mask = (self.slots[None, :] <= self.pos[:, None])[:, None, None, :]   # [B, 1, 1, capacity]
        for i, layer in enumerate(self.layers):
            q, k, v = self._attend(layer, x, self.pos[:, None])
            self.k[i][self.rows, :, self.pos] = k[:, :, 0]
            self.v[i][self.rows, :, self.pos] = v[:, :, 0]
            q = q.reshape(n, self.kv_heads, g, d)                       # heads h = kv * g + j
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask,
                                               scale=layer.self_attn.scaling)
            x = x + layer.self_attn.o_proj(o.reshape(n, 1, self.heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        nxt = choose(self.lm_head(self.base.norm(x[:, 0])), self.temperature, self.top_p)
        self.answers[self.rows, self.count] = nxt
        return nxt

    def prefill(self, rows: list[int], contexts: list[list[int]]) -> None:
        """Start ``contexts`` in ``rows``: their caches written from slot 0, their first answer token
        chosen, their counters reset. Eager, at the contexts' own (right-padded) width."""
        dev, g = self.ids.device, self.heads // self.kv_heads
        lens = torch.tensor([len(c) for c in contexts], device=dev)
        width = int(lens.max())
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        for j, c in enumerate(contexts):                 # right padding: after the real tokens, unseen by them
            ids[j, :len(c)] = torch.tensor(c)
        ids, r = ids.to(dev), torch.tensor(rows, device=dev)
        pos = torch.arange(width, device=dev)[None].expand(len(contexts), width)
        x = self.base.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self._attend(layer, x, pos)
            self.k[i][r, :, :width] = k
            self.v[i][r, :, :width] = v
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                               is_causal=True, scale=layer.self_attn.scaling)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(len(contexts), width, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(len(contexts), device=dev), lens - 1]     # [n, H]
        first = choose(self.lm_head(self.base.norm(last)), self.temperature, self.top_p)
        self.ids[r], self.pos[r], self.count[r] = first, lens, 1
        self.answers[r, 0] = first

    def close(self) -> None:
        """Drop the caches and the captured graph now. The step holds a bound method of this object
        (a reference cycle), so without this the ~``2 x layers x B x capacity`` cache of a finished
        call lives until Python's cycle collector runs, and the next call's cache is allocated beside
        it: on a GPU shared by two regeneration passes that is an out-of-memory error."""
        self.step = None
        self.k = self.v = self.answers = None

    def advance(self) -> None:
        """One decode step for every row (a graph replay on CUDA), then each row's next input."""
        nxt = self.step()
        self.ids.copy_(nxt)
        self.pos.add_(1).clamp_(max=self.capacity - 1)                  # idle rows stay in range
        self.count.add_(1).clamp_(max=self.width - 1)


@torch.no_grad()
def decode(model, contexts: list[list[int]], *, max_new_tokens: int, eos: list[int], batch_size: int,
           temperature: float = 0.0, top_p: float = 1.0, graphs: bool = True,
           check_every: int = CHECK_EVERY, repetition_keep: int | None = None) -> list[list[int]]:
    """The answer to each context, in order: its tokens up to and including the first of ``eos``,
    or its first ``max_new_tokens`` tokens when none came.

    Args:
        model: a Llama or Qwen3 causal LM (transformers), in eval mode, on its device.
        contexts: token ids of each prompt, each non-empty.
        batch_size: rows decoded at once (the KV cache holds ``batch_size x (longest context +
            max_new_tokens + check_every)`` positions per layer).
        repetition_keep: when set, a row whose answer falls into a repetition loop
            (:mod:`dflash.repetition`) ends ``repetition_keep`` tokens after the loop's start
            (or at its end token, if that comes first), its slot refilled: the loop is never
            decoded to ``max_new_tokens``. Found on the device at each look at the rows (windows
            compared by a 64-bit hash, :func:`loop_starts`) and confirmed token by token on the host.

    Raises:
        ValueError: the target is not one this engine runs (:func:`check_model`).
    """
    if not contexts:
        return []
    batch = min(batch_size, len(contexts))
    capacity = positions_for(max(map(len, contexts)), max_new_tokens, check_every)   # aligned rows
    run = SlotDecoder(model, batch, capacity, max_new_tokens, temperature, top_p, graphs, check_every)
    try:
        return _drain(run, contexts, max_new_tokens, eos, batch, repetition_keep)
    finally:
        run.close()
        if run.ids.is_cuda:   # the freed cache back to the driver: another process on this GPU may need it
            torch.cuda.empty_cache()


def loop_starts(answers: torch.Tensor, count: torch.Tensor, ngram: int = NGRAM) -> torch.Tensor:
    """``[B]`` int64: each row's repetition loop start among its first ``count`` tokens of ``answers
    [B, W]`` (the first window of ``ngram`` tokens equal to one starting earlier), ``W`` where none.

    On the device, with no host read: windows hashed (64-bit, wrapping), sorted stably per row, and
    each equal pair's later window a repeat. A hash collision can name a start that is none, so a
    caller confirms it (:func:`dflash.repetition.loop_start`); a true start is never missed.
    """
    rows, width = answers.shape
    if width <= ngram:
        return torch.full((rows,), width, dtype=torch.long, device=answers.device)
    windows = answers.unfold(1, ngram, 1)                                  # [B, M, ngram]
    h = (windows * _hash_powers(ngram, answers.device)).sum(-1)            # int64, wraps
    at = torch.arange(windows.shape[1], device=answers.device)[None]
    h = torch.where(at + ngram <= count[:, None], h, -1 - at)               # past the answer: one value each
    values, order = torch.sort(h, dim=1, stable=True)
    repeat = values[:, 1:] == values[:, :-1]
    return torch.where(repeat, order[:, 1:], width).amin(1)


@cache
def _hash_powers(ngram: int, device) -> torch.Tensor:
    """``[ngram]`` int64 powers of the repetition hash's base (the same as
    :mod:`dflash.repetition`'s, as two's-complement int64), built once per device: every look at
    the rows uses them."""
    base, mod = int(HASH_BASE), 1 << 64
    powers = [pow(base, ngram - 1 - k, mod) for k in range(ngram)]
    return torch.tensor([p - mod if p >= 1 << 63 else p for p in powers], dtype=torch.long, device=device)


def _drain(run: SlotDecoder, contexts, max_new_tokens, eos, batch, keep: int | None = None) -> list[list[int]]:
    """Every context through ``run``'s rows (refilled as answers end); the answers in order."""
    check_every = run.check_every
    stop = torch.tensor(sorted(set(eos)), device=run.ids.device)
    columns = torch.arange(run.width, device=run.ids.device)[None]
    pending, free = deque(sorted(range(len(contexts)), key=lambda i: -len(contexts[i]))), list(range(batch))
    active: dict[int, int] = {}                          # row -> context index
    out: list[list[int] | None] = [None] * len(contexts)
    while pending or active:
        start = []
        while free and pending:
            start.append((free.pop(), pending.popleft()))
        while start:                                     # longest first: a prefill's rows are of similar width
            n = max(1, PREFILL_TOKENS // len(contexts[start[0][1]]))
            part, start = start[:n], start[n:]
            run.prefill([row for row, _ in part], [contexts[i] for _, i in part])
            active.update(part)
        for _ in range(check_every):
            run.advance()
        # on the device: each row's first end token among its answer tokens (width: none yet), and
        # with `keep` its repetition loop's start; one host read for all three
        hit = torch.isin(run.answers, stop) & (columns < run.count[:, None])
        looks = [torch.where(hit.any(1), hit.int().argmax(1), run.width), run.count]
        if keep is not None:
            looks.append(loop_starts(run.answers, run.count))
        first, counts, *loops = torch.stack(looks).tolist()
        done = [row for row in active if first[row] < max_new_tokens or counts[row] >= max_new_tokens]
        ending = set(done)
        looped = [row for row in active if loops and row not in ending and loops[0][row] + keep <= counts[row]]
        if done or looped:
            rows = run.answers[torch.tensor(done + looped, device=run.ids.device)].tolist()
            for row, got in zip(done + looped, rows):   # an end token past max_new_tokens is cut off, as generate would
                end = min(first[row] + 1, max_new_tokens)
                if keep is not None:   # confirmed on the answer proper: no token past its end counts
                    start = loop_start(np.asarray(got[:min(counts[row], end)], dtype=np.int64))
                    if start is not None and start + keep <= counts[row]:
                        end = min(end, start + keep)
                    elif row not in ending:
                        continue                       # a hash collision, no loop: the row goes on
                out[active.pop(row)] = got[:end]
                free.append(row)
    return out
