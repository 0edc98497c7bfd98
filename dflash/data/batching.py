"""Batching strategies: an epoch's batch plan as a pure function of (lengths, settings, seed, epoch).

A *plan* is a list of :class:`PlannedBatch`; each row of a batch is a list of
``(conversation, start, stop)`` token spans laid side by side. The four strategies
(``data.strategy``):

* ``sorted``: conversations sorted by length (ties by index), cut into ``batch_size`` rows, in
  increasing length; the same every epoch. Least padding of the padded strategies, least diverse.
* ``random``: a seeded permutation cut into ``batch_size`` rows, padded to the longest row.
* ``bucketed``: ``num_buckets`` equal-count length buckets, shuffled within each bucket and cut
  into batches; the batch order interleaves buckets so that no two consecutive batches come from
  the same bucket (while two or more buckets have batches left), choosing the next bucket at random
  with probability proportional to its remaining batches.
* ``packed``: rows of exactly ``pack_length`` tokens (``tokens_per_batch // packed_rows``) filled
  with whole conversations in random order by first-fit over ``pack_window`` open rows (the
  fullest row is closed when the window is full); ``packed_rows`` rows per batch. A conversation
  longer than ``pack_length`` is cut into ``pack_length`` pieces, each its own document (positions
  restart at 0, so keep ``pack_length >= max_length`` to never cut).

  Every packed batch is exactly ``[packed_rows, pack_length]``: when the rows do not divide into
  ``packed_rows``, the epoch's last batch is filled with *empty rows* (no spans; collated as all
  padding: ``doc_ids`` -1, ``loss_mask`` False, so no anchor is eligible and no slot is trained).
  The shape is fixed because a compiled stage (``[target] compile``, ``[drafter] compile``) sees
  one shape all epoch: a single ``[1, T]`` batch among ``[4, T]`` ones would run the target
  eagerly and recompile the drafter mid-run (a stall of seconds, and a ``torch.compile`` in one
  thread patches ``nn.Module.__call__`` process-wide while another thread runs modules).

Statistics (:func:`plan_stats`):

* ``padding_waste``: padding tokens / computed tokens (``sum B*T``) over the epoch, a fraction.
  A packed plan's empty filler rows are computed and all padding, so they count in full.
* ``diversity``: mean over batches holding >= 2 documents of ``std(log2 L in batch) /
  std(log2 L over the dataset)``, L = document lengths. About 1 when every batch is a
  representative sample of the data (random, packed); near 0 when each batch holds documents of
  one length (sorted, bucketed): the bias that makes the loss swing from batch to batch.
* ``order_autocorr``: lag-1 autocorrelation of the batch mean log2-length along the epoch. Near 0
  for a random order, near 1 when consecutive batches look alike (sorted; bucketed without the
  interleaving), negative when the order alternates between long and short (interleaved buckets).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np

Span = tuple[int, int, int]
"""``(conversation index, start token, stop token)``."""


class PlannedBatch(NamedTuple):
    """One batch of a plan: ``rows`` of spans, padded (or packed) to ``width`` tokens per row.

    A row may be empty (``[]``, a packed plan's filler row): all padding once collated.
    ``bucket`` is the length bucket (bucketed strategy) or -1.
    """

    rows: list[list[Span]]
    width: int
    bucket: int = -1


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator behind an epoch's order: a function of (seed, epoch) only."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch]))


def _padded(order: np.ndarray, lengths: np.ndarray, batch_size: int, bucket: int = -1) -> list[PlannedBatch]:
    out = []
    for s in range(0, len(order), batch_size):
        idx = order[s: s + batch_size]
        out.append(PlannedBatch([[(int(i), 0, int(lengths[i]))] for i in idx], int(lengths[idx].max()), bucket))
    return out


def plan_sorted(lengths: np.ndarray, batch_size: int) -> list[PlannedBatch]:
    """Length-sorted padded batches (see the module docstring)."""
    return _padded(np.argsort(lengths, kind="stable"), lengths, batch_size)


def plan_random(lengths: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[PlannedBatch]:
    """Random padded batches."""
    return _padded(rng.permutation(len(lengths)), lengths, batch_size)


def plan_bucketed(lengths: np.ndarray, batch_size: int, num_buckets: int,
                  rng: np.random.Generator) -> list[PlannedBatch]:
    """Length-bucketed padded batches, buckets interleaved (see the module docstring)."""
    order = np.argsort(lengths, kind="stable")
    n, nb = len(order), min(num_buckets, len(order))
    queues = []
    for b in range(nb):
        members = rng.permutation(order[b * n // nb: (b + 1) * n // nb])
        queues.append(_padded(members, lengths, batch_size, bucket=b)[::-1])  # pop() from the end
    out: list[PlannedBatch] = []
    prev = -1
    while True:
        left = np.array([len(q) for q in queues], np.float64)
        if prev >= 0 and (left > 0).sum() > 1:
            left[prev] = 0.0
        total = left.sum()
        if total == 0:
            return out
        prev = int(rng.choice(nb, p=left / total))
        out.append(queues[prev].pop())


def plan_packed(lengths: np.ndarray, pack_length: int, packed_rows: int, window: int,
                rng: np.random.Generator) -> list[PlannedBatch]:
    """Packed rows of ``pack_length`` tokens, exactly ``packed_rows`` rows per batch (module docstring).

    Returns:
        The epoch's batches, each with ``len(rows) == packed_rows`` and ``width == pack_length``;
        the last one's trailing rows may be empty (``[]``: filler, all padding once collated).
    """
    open_rows: list[list] = []  # [free tokens, spans]
    closed: list[list[Span]] = []
    for i in rng.permutation(len(lengths)):
        n = int(lengths[i])
        for start in range(0, n, pack_length):
            stop = min(n, start + pack_length)
            size = stop - start
            for row in open_rows:
                if row[0] >= size:
                    row[0] -= size
                    row[1].append((int(i), start, stop))
                    break
            else:
                if len(open_rows) >= window:
                    fullest = min(range(len(open_rows)), key=lambda r: open_rows[r][0])
                    closed.append(open_rows.pop(fullest)[1])
                open_rows.append([pack_length - size, [(int(i), start, stop)]])
    closed.extend(row[1] for row in open_rows)
    closed.extend([] for _ in range(-len(closed) % packed_rows))  # filler: one shape all epoch
    return [PlannedBatch(closed[s: s + packed_rows], pack_length)
            for s in range(0, len(closed), packed_rows)]


class BatchingStats(msgspec.Struct, kw_only=True):
    """One epoch of one strategy, measured on its plan (see the module docstring).

    Attributes:
        strategy: the strategy name.
        num_batches: batches in the epoch.
        num_tokens: real tokens, in tokens.
        num_padding: padding tokens (computed, useless), in tokens.
        padding_waste: ``num_padding / (num_tokens + num_padding)``, a fraction.
        diversity: mean within-batch spread of log-length relative to the dataset's (0..~1).
        order_autocorr: lag-1 autocorrelation of batch mean log-length (-1..1).
        mean_batch_tokens: mean computed tokens (B*T) per batch.
    """

    strategy: str
    num_batches: int
    num_tokens: int
    num_padding: int
    padding_waste: float
    diversity: float
    order_autocorr: float
    mean_batch_tokens: float


def plan_stats(strategy: str, lengths: np.ndarray, plan: list[PlannedBatch]) -> BatchingStats:
    """Padding waste, diversity and order autocorrelation of ``plan`` (module docstring)."""
    log_len = np.log2(np.maximum(lengths, 1).astype(np.float64))
    ref = float(log_len.std()) or 1.0
    real = computed = 0
    spreads, means = [], []
    for pb in plan:
        docs = [s for row in pb.rows for s in row]
        sizes = np.array([stop - start for _, start, stop in docs], np.float64)
        real += int(sizes.sum())
        computed += len(pb.rows) * pb.width
        doc_logs = log_len[[d for d, _, _ in docs]]
        means.append(doc_logs.mean())
        if len(docs) >= 2:
            spreads.append(doc_logs.std() / ref)
    a, b = np.array(means[:-1]), np.array(means[1:])
    autocorr = float(np.corrcoef(a, b)[0, 1]) if len(a) > 1 and a.std() > 0 and b.std() > 0 else 0.0
    return BatchingStats(
        strategy=strategy, num_batches=len(plan), num_tokens=real, num_padding=computed - real,
        padding_waste=(computed - real) / computed if computed else 0.0,
        diversity=float(np.mean(spreads)) if spreads else float("nan"),
        order_autocorr=autocorr, mean_batch_tokens=computed / max(len(plan), 1),
    )
