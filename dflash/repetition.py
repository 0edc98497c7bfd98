"""Repetition loops in assistant answers: found, counted, and optionally kept out of the loss.

A small target's own answers (``dflash.regenerate``, greedy) often fall into a loop: the same
sentence over and over until the token limit (neural text degeneration, Holtzman et al., 2020,
"The Curious Case of Neural Text Degeneration", arXiv:1904.09751). Counted by this module on
SmolLM2-135M-Instruct's answers to ShareGPT's prompts (256 new tokens; ``benchmarks/results/LOG.md``,
"a seventh time"): 54% of the greedy answers' loss tokens lie from a loop's start on, 18% of the
sampled ones' (T = 0.8), and 72% of the greedy answers reach the token limit. Such a tail is
trivial to draft (copy what came before): trained on, it takes a large share of the sampled
anchors and inflates the teacher-forced streak far above what a decode of a fresh prompt
measures, where most of the answer has not looped yet.

The rule, per trained span (a contiguous run of the loss mask: one assistant turn and its
end-of-turn token): the loop starts at the first position ``r`` whose :data:`NGRAM`-token window
equals a window that started earlier in the same span (windows may overlap, so a token repeated
``NGRAM`` times counts). ``keep`` tokens from ``r`` stay in the loss (the drafter still learns to
copy a loop, which decodes meet), and the rest of the span leaves it. The tokens stay in the
sequence either way: the target reads them, so every later turn keeps its context.

Windows are compared by a 64-bit polynomial hash, then the first candidate is confirmed token by
token, so a hash collision can never cut a span.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NGRAM = 16
"""Tokens a window holds: an exact repeat of 16 tokens inside one answer is a loop (or a copied
line of code, which is as easy to draft) far more often than prose that merely reuses a phrase."""

HASH_BASE = np.uint64(0x9E3779B97F4A7C15)
"""The base of the windows' polynomial hash (odd, so every power is too: no window's tokens are
multiplied away); :mod:`dflash.model.slots` hashes the same way on the device."""


class RepetitionCount(NamedTuple):
    """What :func:`mask_repetition` found in one conversation.

    Attributes:
        looping_spans: trained spans that repeat an earlier window of themselves.
        loop_tokens: loss tokens from each loop's start to its span's end, in tokens (masked or not).
        masked_tokens: of those, the loss tokens taken out of the mask (0 when ``keep`` is None).
    """

    looping_spans: int
    loop_tokens: int
    masked_tokens: int


def _spans(mask: np.ndarray) -> np.ndarray:
    """``[S, 2]`` (start, end) of each contiguous run of ``mask != 0``."""
    edges = np.diff(np.concatenate(([0], (mask != 0).astype(np.int8), [0])))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)


def loop_start(ids: np.ndarray, ngram: int = NGRAM) -> int | None:
    """The first position of ``ids`` (``[n]`` integer token ids) whose ``ngram``-token window equals
    a window starting earlier, or None when no window repeats (or ``n < ngram + 1``)."""
    n = len(ids) - ngram + 1
    if n < 2:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(ids.astype(np.uint64), ngram)
    powers = HASH_BASE ** np.arange(ngram - 1, -1, -1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        hashes = windows @ powers   # wraps modulo 2**64
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    for i in np.flatnonzero(first[inverse] < np.arange(n)).tolist():
        j = int(first[inverse[i]])
        if np.array_equal(ids[i:i + ngram], ids[j:j + ngram]):
            return i
    return None


def mask_repetition(ids: np.ndarray, mask: np.ndarray, keep: int | None,
                    ngram: int = NGRAM) -> tuple[np.ndarray, RepetitionCount]:
    """Find each trained span's loop and, with ``keep`` set, keep only its first ``keep`` tokens in
    the loss (the module docstring gives the rule).

    Args:
        ids: ``[L]`` integer token ids of one conversation.
        mask: ``[L]`` uint8 loss mask, 1 on trained tokens.
        keep: loss tokens kept from a loop's start (``[data].repetition_keep``); None counts only.
        ngram: window length in tokens.

    Returns:
        The mask (a new array when a token left it, else ``mask`` itself) and the count.
    """
    spans = loops = masked = 0
    out = mask
    for s, e in _spans(mask).tolist():
        r = loop_start(ids[s:e], ngram)
        if r is None:
            continue
        spans += 1
        loops += e - s - r
        if keep is not None and r + keep < e - s:
            if out is mask:
                out = mask.copy()
            out[s + r + keep:e] = 0
            masked += e - s - r - keep
    return out, RepetitionCount(spans, loops, masked)
