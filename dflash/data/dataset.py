"""``TokenizedDataset``: flat token arrays of tokenized conversations, and its load summary.

Storage is three flat arrays (what the on-disk cache holds, memory-mapped on reload):

* ``tokens``: ``[total_tokens]`` int32 token ids of every conversation, back to back;
* ``loss_mask``: ``[total_tokens]`` uint8, 1 on trained (assistant) tokens;
* ``offsets``: ``[N + 1]`` int64, conversation ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.

A dataset may be a *view* (``rows``: int64 indices into the stored conversations), which is how
the evaluation holdout is split off without copying.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import msgspec
import numpy as np


class DataSummary(msgspec.Struct, kw_only=True):
    """What loading the data did; returned with the dataset, printed, and logged by the run.

    Attributes:
        source: data.source as given.
        path: the file read.
        cache_path: the cache entry directory.
        from_cache: True when the arrays were loaded from the cache (no tokenization).
        records_read: records looked at in the file (usable and skipped ones; reading stops once
            ``max_samples`` usable ones are in hand).
        conversations: conversations kept (tokenized, passed the drop rule).
        skipped: skip reason -> count (see dflash.data.sources and dflash.data.chat).
        truncated: kept conversations cut to max_length (counted, not skipped).
        num_tokens: tokens kept, in tokens.
        num_loss_tokens: trained tokens kept, in tokens.
        reasoning_turns: assistant turns with reasoning in the kept conversations.
        reasoning_dropped: of those, turns whose reasoning is not in the tokens (data.reasoning =
            "drop", or left out by the chat template).
        seconds: wall time of this load (tokenization or cache reload), in seconds.
        max_length: data.max_length the conversations were cut to, in tokens (0: not recorded,
            a summary cached before it was; so are the three below).
        truncated_cut: median tokens cut from a truncated conversation, in tokens.
        longest: the longest kept conversation before truncation, in tokens.
        joined_from: with ``data.join``, the conversations kept before they were joined into the
            ``conversations`` documents (0: not joined).
        whole_at: the data.max_length that keeps :data:`WHOLE_SHARE` of the kept conversations whole
            (their length at that quantile, rounded up to a multiple of 64), in tokens.
        max_samples: data.max_samples when reading stopped at it (the file has more records), else 0.
        looping_turns: trained spans (assistant turns) of the kept conversations that fall into a
            repetition loop (:mod:`dflash.repetition`).
        loop_tokens: loss tokens from each loop's start to its turn's end, before any masking, in
            tokens.
        loop_tokens_masked: of those, the tokens ``data.repetition_keep`` took out of the loss.
        The lengths past ``max_length`` are estimated from characters (:mod:`dflash.data.chat`).
    """

    source: str
    path: str
    cache_path: str
    from_cache: bool
    records_read: int
    conversations: int
    skipped: dict[str, int]
    truncated: int
    num_tokens: int
    num_loss_tokens: int
    reasoning_turns: int = 0
    reasoning_dropped: int = 0
    seconds: float = 0.0
    max_length: int = 0
    truncated_cut: int = 0
    longest: int = 0
    whole_at: int = 0
    joined_from: int = 0
    max_samples: int = 0
    looping_turns: int = 0
    loop_tokens: int = 0
    loop_tokens_masked: int = 0

    def to_dict(self) -> dict:
        """JSON-able dict (for logs)."""
        return msgspec.to_builtins(self)


WHOLE_SHARE = 0.9
"""The share of conversations the suggested data.max_length keeps whole (:attr:`DataSummary.whole_at`)."""


def truncation_text(summary: DataSummary) -> str:
    """How many kept conversations ``max_length`` cut, by how much, and the ``data.max_length``
    that would keep :data:`WHOLE_SHARE` of them whole (when the present one does not)."""
    n, of = summary.truncated, summary.conversations
    if not n or not summary.max_length:  # none cut, or a summary cached before these were recorded
        return f"{n:,}"
    text = (f"{n:,} of {of:,} ({n / of:.0%}) longer than data.max_length = {summary.max_length:,}, cut by about "
            f"{summary.truncated_cut:,} tokens each (median; the longest has about {summary.longest:,})")
    if summary.whole_at > summary.max_length:
        text += f"; data.max_length = {summary.whole_at:,} keeps {WHOLE_SHARE:.0%} whole"
    return text


def stopped_text(summary: DataSummary) -> str:
    """`` (reading stopped at data.max_samples = 4,000 usable conversations)`` or "": why more
    records were read than conversations were tokenized, and that the file has more."""
    if not summary.max_samples:
        return ""
    return f" (reading stopped at data.max_samples = {summary.max_samples:,} usable conversations)"


def loops_text(summary: DataSummary) -> str:
    """How many trained turns fall into a repetition loop, the share of the loss tokens inside
    loops, and what ``data.repetition_keep`` did (or would do) about them."""
    loss_before = summary.num_loss_tokens + summary.loop_tokens_masked
    share = summary.loop_tokens / max(loss_before, 1)
    text = f"{summary.looping_turns:,}, holding {summary.loop_tokens:,} loss tokens from the loop on ({share:.0%})"
    if summary.loop_tokens_masked:
        return text + f"; data.repetition_keep took {summary.loop_tokens_masked:,} out of the loss"
    if share >= LOOP_HINT_SHARE:
        text += "; data.repetition_keep = 64 trains on each loop's first 64 tokens only"
    return text


LOOP_HINT_SHARE = 0.1
"""The share of loss tokens inside repetition loops from which the summary suggests
``data.repetition_keep`` (a tenth: below it the loops cost little of the training)."""


def summary_rows(summary: DataSummary) -> list[tuple[str, str]]:
    """The summary as (label, value) rows, in the order they are shown."""
    rows = [("records read", f"{summary.records_read:,}{stopped_text(summary)}"),
            ("conversations kept", f"{summary.conversations:,}" if not summary.joined_from else
             f"{summary.joined_from:,}, joined into {summary.conversations:,} documents of up to "
             f"data.max_length = {summary.max_length:,} tokens (data.join)"),
            ("tokens / loss tokens", f"{summary.num_tokens:,} / {summary.num_loss_tokens:,}"),
            ("truncated to max_length (kept)", truncation_text(summary))]
    if summary.looping_turns:
        rows.append(("turns that loop", loops_text(summary)))
    if summary.reasoning_turns:
        rows.append(("turns with reasoning / reasoning not in tokens",
                     f"{summary.reasoning_turns:,} / {summary.reasoning_dropped:,}"))
    rows += [(f"skipped: {reason}", f"{n:,}") for reason, n in sorted(summary.skipped.items())]
    rows.append(("cache", summary.cache_path))
    return rows


def print_summary(summary: DataSummary, console=None) -> None:
    """Print the summary to ``console`` (default: stderr): a rich table on a terminal; elsewhere
    (a pipe, a log file, CI) plain aligned lines, a title then ``  label  value``, with no box
    drawing."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    how = "cache hit" if summary.from_cache else "tokenized"
    title = f"data: {summary.source} ({how}, {summary.seconds:.1f} s)"
    rows = summary_rows(summary)
    if not console.is_terminal:
        width = max(len(k) for k, _ in rows)
        text = "\n".join([title, *(f"  {k:<{width}}  {v}" for k, v in rows)])
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=title, show_header=False)
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


MAX_ANSWERS_PER_PROMPT = 8
"""The most conversations one prompt may have and still be taken as one question answered several
times (regeneration passes, repeats) by :meth:`TokenizedDataset.split`; a prompt shared more widely
is a common preamble, and holding out its conversations must not empty the training data."""


class TokenizedDataset:
    """Tokenized conversations (see the module docstring for the array layout).

    Args:
        tokens, loss_mask, offsets: the flat arrays (may be read-only memory maps).
        summary: the load summary (None for hand-built datasets in tests).
        key: identity of the stored arrays (the cache key), part of :attr:`fingerprint`.
        rows: optional ``[n]`` int64 indices of the stored conversations this view exposes.
    """

    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, *,
                 summary: DataSummary | None = None, key: str = "", rows: np.ndarray | None = None):
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[-1] != len(tokens) or len(loss_mask) != len(tokens):
            raise ValueError("offsets must be [N+1] ending at len(tokens); loss_mask as long as tokens")
        self.tokens = tokens
        self.loss_mask = loss_mask
        self.offsets = offsets
        self.summary = summary
        self.key = key
        self.rows = np.arange(len(offsets) - 1, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        starts = offsets[:-1][self.rows]
        self.lengths: np.ndarray = (offsets[1:][self.rows] - starts).astype(np.int64)
        """``[len(self)]`` int64 tokens per conversation."""
        self._starts = starts.astype(np.int64)
        self.same_prompt_dropped = 0
        """Conversations :meth:`split` left out of this training view: their prompt is a held-out one's."""

    @classmethod
    def from_sequences(cls, ids: list, masks: list | None = None, **kw) -> "TokenizedDataset":
        """Build from per-conversation id lists (and 0/1 masks; default all ones)."""
        lengths = [len(x) for x in ids]
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate([np.asarray(x, np.int32) for x in ids]) if ids else np.zeros(0, np.int32)
        if masks is None:
            mask = np.ones(len(tokens), np.uint8)
        else:
            mask = np.concatenate([np.asarray(m, np.uint8) for m in masks]) if masks else np.zeros(0, np.uint8)
        return cls(tokens, mask, offsets, **kw)

    def __len__(self) -> int:
        return len(self.rows)

    def span(self, i: int, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids ``[n]`` int32 and loss mask ``[n]`` uint8 of conversation ``i`` (this view's
        index), tokens ``start:stop``."""
        base = int(self._starts[i])
        stop = int(self.lengths[i]) if stop is None else stop
        return self.tokens[base + start: base + stop], self.loss_mask[base + start: base + stop]

    def prompt(self, i: int) -> np.ndarray:
        """``[P]`` int32 ids of conversation ``i`` before its first trained token: the context a
        real decode (dflash.eval) starts generating from. Empty if the first token is trained."""
        ids, mask = self.span(i)
        return ids[: int(np.argmax(mask))] if mask.any() else ids

    def subset(self, indices: np.ndarray) -> "TokenizedDataset":
        """A view of conversations ``indices`` (this view's indices), without copying tokens."""
        return TokenizedDataset(self.tokens, self.loss_mask, self.offsets, summary=self.summary,
                                key=self.key, rows=self.rows[np.asarray(indices, np.int64)])

    def last_prompt(self, i: int) -> np.ndarray:
        """``[P]`` int32 ids of conversation ``i`` before its last run of trained tokens (its last
        assistant turn; in a joined document, ``data.join``, the last conversation's last turn, so
        many conversations deep): the longest context a real decode of it starts from, for tau by
        context length. Equal to :meth:`prompt` for a single-turn conversation; empty if nothing
        comes before it."""
        ids, mask = self.span(i)
        trained = np.asarray(mask, bool)
        starts = np.flatnonzero(trained[1:] & ~trained[:-1]) + 1    # where a trained run begins after context
        return ids[: int(starts[-1])] if len(starts) else ids[: int(np.argmax(trained))] if trained.any() else ids

    def split(self, holdout: int | None, seed: int) -> tuple["TokenizedDataset", "TokenizedDataset"]:
        """(train, heldout): :func:`holdout_count` conversations chosen by ``seed``, the rest for
        training, less every conversation whose prompt (:meth:`prompt`: the tokens before the first
        trained one, chat template included) is a held-out one's. Held-out prompts are then never
        trained on in any answer: a regenerated file holds each prompt once per pass (greedy,
        sampled), and ShareGPT repeats some prompts, so without this a held-out figure would partly
        measure answers to prompts the drafter trained on. Conversations with an empty prompt are
        not compared, nor a prompt more than :data:`MAX_ANSWERS_PER_PROMPT` conversations share (a
        common preamble, e.g. a chat template's header before an opening assistant turn, not one
        question). The train view's ``same_prompt_dropped`` counts what this left out (0 for
        data without repeated prompts, whose split is then what a plain random split gives). Both
        keep file order. Joined documents (``data.join``) compare their first conversation's prompt.

        Raises:
            ValueError: ``holdout >= len(self)`` (nothing left to train on): lower data.holdout.
        """
        holdout = holdout_count(holdout, len(self))
        if holdout >= len(self):
            raise ValueError(f"data.holdout = {holdout} leaves no training data ({len(self)} conversations)")
        perm = np.random.default_rng([seed, 0x401D]).permutation(len(self))
        held = np.sort(perm[:holdout])
        train = perm[holdout:]
        held_keys = [self._prompt_key(i) for i in held]
        held_prompts = {k for k in held_keys if k is not None}
        train_keys = [self._prompt_key(i) for i in train] if held_prompts else []
        answers = Counter(k for k in (*held_keys, *train_keys) if k in held_prompts)
        grouped = {k for k, n in answers.items() if n <= MAX_ANSWERS_PER_PROMPT}
        same = np.array([k in grouped for k in train_keys], bool) if grouped else np.zeros(len(train), bool)
        out = self.subset(np.sort(train[~same]))
        out.same_prompt_dropped = int(same.sum())
        return out, self.subset(held)

    def _prompt_key(self, i: int) -> bytes | None:
        """A digest of conversation ``i``'s prompt (None when it is empty): equal prompts, equal keys."""
        ids = self.prompt(int(i))
        return hashlib.blake2b(np.ascontiguousarray(ids, np.int32).tobytes(), digest_size=16).digest() \
            if len(ids) else None

    @property
    def fingerprint(self) -> str:
        """Short hash of the stored arrays' key and this view's rows; a sampler state is only
        valid for a dataset with the same fingerprint."""
        h = hashlib.sha256(self.key.encode())
        h.update(np.ascontiguousarray(self.rows).tobytes())
        h.update(np.ascontiguousarray(self.lengths).tobytes())
        return h.hexdigest()[:16]


HOLDOUT_DEFAULT = 64
"""Conversations held out when ``[data].holdout`` is left out, on a dataset large enough for it."""
HOLDOUT_MAX_SHARE = 10
"""A left-out ``[data].holdout`` never takes more than 1/10 of the conversations kept."""


def holdout_count(holdout: int | None, n: int) -> int:
    """Conversations held out of ``n``: ``holdout`` as given, or, when it is None (left out),
    :data:`HOLDOUT_DEFAULT` but at most ``n // HOLDOUT_MAX_SHARE``: 64 of 1,000, 7 of 72. The one
    rule both ``dflash.run`` and ``dflash.eval`` apply, so eval decodes what the run held out."""
    return min(HOLDOUT_DEFAULT, n // HOLDOUT_MAX_SHARE) if holdout is None else holdout
