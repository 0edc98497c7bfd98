"""The target's answers to many contexts at once: what ``python -m dflash.regenerate`` asks of it.

Three engines:

* ``"generate"``: ``model.generate`` over left-padded batches of ``batch_size`` contexts, sorted by
  length so that similar lengths share a batch. A batch decodes until its longest answer ends: a
  row that finished early still rides along (padding). The KV cache grows by concatenation
  (``cache="dynamic"``), or is allocated once per batch at its final length (``cache="static"``:
  transformers then compiles the decode step, and the prompt width is rounded up to a multiple of
  ``STATIC_WIDTH`` so that few shapes are compiled).
* ``"continuous"``: transformers' continuous batching (``model.generate_batch``, transformers >= 5):
  a paged KV cache, and requests scheduled into the running batch as others finish, so no step is
  spent on a finished answer and no context is padded. It is the serving engines' way of keeping
  a GPU busy with many answers of unequal length; on a CPU it is slower than ``"generate"``.
* ``"slots"``: this project's :mod:`dflash.model.slots`: ``batch_size`` rows over one static KV
  cache, the decode step a CUDA graph, a row refilled with the next context when its answer ends
  (Llama and Qwen3 targets). Written because the two above leave an H100 mostly idle on a small
  target (measured in that module's docstring).

With ``repetition_keep`` set, an answer that falls into a repetition loop (a 16-token window
repeating an earlier one of the same answer: :mod:`dflash.repetition`) ends ``repetition_keep``
tokens after the loop's start, unfinished. Every engine's answers are cut by the same rule, so the
cut depends on the tokens alone; the slots engine also stops decoding such a row there and gives
its slot to the next context, the others decode the loop to its end first.

Greedy answers are the target's argmax either way; batching changes the order of floating-point
sums, so in bf16 on a GPU an answer may part from another engine's (or batch size's) where two
logits tie to rounding, as it would between any two batch sizes; in fp32 on a CPU they are
token-identical (tested). Sampled answers come from the same distribution, not the same draws.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["CACHES", "ENGINES", "Cache", "Engine", "answer", "check_engine", "loop_cut"]

Engine = Literal["generate", "continuous", "slots"]
ENGINES: tuple[Engine, ...] = ("generate", "continuous", "slots")
Cache = Literal["dynamic", "static"]
CACHES: tuple[Cache, ...] = ("dynamic", "static")
STATIC_WIDTH = 128
"""With a static cache, prompt widths are rounded up to a multiple of this many tokens: each width
is a shape transformers compiles its decode step for."""


def check_engine(engine: str) -> None:
    """Raise ValueError (one line, what to do) when ``engine`` cannot run with the installed
    transformers: ``"continuous"`` needs transformers 5 (4.x's ``generate_batch`` returns another
    shape and is experimental)."""
    import transformers

    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {list(ENGINES)}")
    if engine == "continuous" and int(transformers.__version__.split(".")[0]) < 5:
        raise ValueError(f"the continuous engine needs transformers >= 5 (installed: {transformers.__version__}); "
                         "use --engine generate or upgrade transformers")


@torch.no_grad()
def answer(model, contexts: list[list[int]], *, max_new_tokens: int, eos: list[int], pad: int,
           temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 32,
           engine: Engine = "generate", cache: Cache = "dynamic",
           repetition_keep: int | None = None) -> list[tuple[list[int], bool]]:
    """One answer per context: ``[(answer token ids without the end token, finished)]`` in the
    order of ``contexts``; ``finished`` is False when the answer reached ``max_new_tokens`` or was
    cut in a repetition loop.

    Args:
        model: a transformers causal LM (the target, in eval mode, on its device).
        contexts: token ids of each prompt (chat template applied), each non-empty.
        eos: the token ids that end an answer; pad: the id left padding uses (``"generate"``).
        temperature: 0 = greedy; otherwise sampled at this temperature with ``top_p``.
        batch_size: contexts per ``generate`` call (``"generate"``), rows decoded at once
            (``"slots"``); the continuous engine schedules by its cache's room.
        cache: ``"dynamic"`` or ``"static"`` KV cache (``"generate"`` only; module docstring).
        repetition_keep: tokens an answer keeps from a repetition loop's start (module docstring);
            None keeps every token.

    Raises:
        ValueError: ``engine`` cannot run here (:func:`check_engine`), or ``"slots"`` does not run
            this target (:func:`dflash.model.slots.check_model`).
    """
    check_engine(engine)
    if not contexts:
        return []
    sample = temperature > 0
    # top_k 0: no top-k cut (transformers' default is 50), so every engine samples one distribution
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if sample else
                {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
    if engine == "slots":
        from dflash.model.slots import decode

        rows = decode(model, contexts, max_new_tokens=max_new_tokens, eos=eos, batch_size=batch_size,
                      temperature=temperature, top_p=top_p, repetition_keep=repetition_keep)
    elif engine == "continuous":
        rows = _continuous(model, contexts, max_new_tokens, eos, pad, sampling)
    else:
        rows = _padded(model, contexts, max_new_tokens, eos, pad, sampling, batch_size, cache)
    out = []
    for row in rows:
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        ans, finished = (row if cut is None else row[:cut]), cut is not None
        if repetition_keep is not None:
            end = loop_cut(ans, repetition_keep)
            if end is not None:
                ans, finished = ans[:end], False
        out.append((ans, finished))
    return out


def loop_cut(tokens: list[int], keep: int) -> int | None:
    """Where an answer of ``tokens`` ends under ``repetition_keep = keep``: ``keep`` tokens after its
    repetition loop's start, or None when it has no loop or the loop is no longer than ``keep``."""
    import numpy as np

    from dflash.repetition import loop_start

    start = loop_start(np.asarray(tokens, dtype=np.int64))
    return start + keep if start is not None and start + keep < len(tokens) else None


def _padded(model, contexts, max_new_tokens, eos, pad, sampling, batch_size, cache="dynamic") -> list[list[int]]:
    """``model.generate`` over length-sorted, left-padded batches; the new tokens of each context."""
    device = next(model.parameters()).device
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))  # similar lengths share a batch
    rows: list[list[int]] = [[] for _ in contexts]
    for b in range(0, len(order), batch_size):
        part = order[b: b + batch_size]
        width = max(len(contexts[i]) for i in part)
        if cache == "static":
            width = -(-width // STATIC_WIDTH) * STATIC_WIDTH
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(part):                      # left padding: answers start aligned
            ids[r, width - len(contexts[i]):] = torch.tensor(contexts[i])
            mask[r, width - len(contexts[i]):] = 1
        new = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, **sampling, **extra)[:, width:].tolist()
        for r, i in enumerate(part):
            rows[i] = new[r]
    return rows


def _continuous(model, contexts, max_new_tokens, eos, pad, sampling) -> list[list[int]]:
    """transformers' continuous batching over every context at once; the new tokens of each."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
    extra = {}
    cache = _cache_for(contexts, max_new_tokens) if next(model.parameters()).device.type == "cpu" else None
    if cache is not None:
        extra["continuous_batching_config"] = cache
    results = model.generate_batch(inputs=[list(c) for c in contexts], generation_config=config, **extra)
    # matched by prompt: identical contexts get identical greedy answers, and each is used once
    by_prompt: dict[tuple[int, ...], list] = {}
    for out in results.values():
        if getattr(out, "error", None):
            raise RuntimeError(f"continuous batching failed on request {out.request_id}: {out.error}")
        by_prompt.setdefault(tuple(out.prompt_ids), []).append(out)
    return [list(by_prompt[tuple(c)].pop(0).generated_tokens) for c in contexts]


CPU_PAGE = 256
"""Tokens per page of the continuous engine's paged cache on a CPU (transformers' default page)."""


def _cache_for(contexts, max_new_tokens):
    """A continuous-batching cache sized to these requests, for a CPU. Left to itself transformers
    sizes the cache from the device's free memory, which on a CPU is the host's RAM: gigabytes
    allocated and zeroed before the first token (2 minutes of a 2-core machine for three prompts,
    and past a test's timeout under load; 11 s sized). Every request's context and answer fit at
    once. None where this transformers has no such setting (its defaults then)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None

    blocks = sum(-(-(len(c) + max_new_tokens) // CPU_PAGE) for c in contexts)
    tokens = sum(len(c) for c in contexts) + len(contexts)
    return ContinuousBatchingConfig(page_size=CPU_PAGE, num_blocks=blocks + 1, max_batch_tokens=min(tokens, 4096))
