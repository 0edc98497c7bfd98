"""``Sampler``: an endless (or bounded), resumable stream of :class:`dflash.messages.Batch`.

The order is a pure function of (seed, epoch): epoch ``e``'s plan is
``plan_<strategy>(lengths, ..., epoch_rng(seed, e))`` (see :mod:`dflash.data.batching`). The
sampler's position is three integers, ``epoch``, ``index`` (next batch within the epoch) and
``batch_id`` (next global batch id), so ``state_dict()`` is a small JSON-able dict and a sampler
built on the same dataset and settings and given that dict yields exactly the batches the
uninterrupted sampler would have yielded next. Every Batch carries the state *after* itself in
``Batch.sampler_state``: checkpoint the state of the last batch trained on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dflash.data.batching import (
    BatchingStats,
    PlannedBatch,
    epoch_rng,
    plan_bucketed,
    plan_packed,
    plan_random,
    plan_sorted,
    plan_stats,
)
from dflash.data.config import DataConfig, DataError
from dflash.data.dataset import TokenizedDataset
from dflash.messages import Batch

STATE_VERSION = 1


def collate(dataset: TokenizedDataset, pb: PlannedBatch, pad_id: int, *, seq: int = 0,
            batch_id: int = 0, epoch: int = 0) -> Batch:
    """Materialise one planned batch as a :class:`~dflash.messages.Batch` (CPU tensors).

    Shapes: ``B = len(pb.rows)``, ``T = pb.width``. ``input_ids`` [B,T] int64 (``pad_id`` on
    padding), ``loss_mask`` [B,T] bool, ``position_ids`` [B,T] int64 restarting at 0 at every
    document (0 on padding), ``doc_ids`` [B,T] int32 numbering documents 0.. within each row (-1 on
    padding). An empty row (a packed plan's filler, see :mod:`dflash.data.batching`) is all
    padding: ``pad_id``, mask False, position 0, doc -1. ``num_tokens`` counts real tokens and
    ``num_padding = B*T - num_tokens``. ``sampler_state`` is left empty (the Sampler fills it).
    """
    b, t = len(pb.rows), pb.width
    ids = np.full((b, t), pad_id, np.int64)
    mask = np.zeros((b, t), np.bool_)
    pos = np.zeros((b, t), np.int64)
    doc = np.full((b, t), -1, np.int32)
    real = 0
    for r, row in enumerate(pb.rows):
        col = 0
        for d, (conv, start, stop) in enumerate(row):
            n = stop - start
            toks, m = dataset.span(conv, start, stop)
            ids[r, col: col + n] = toks
            mask[r, col: col + n] = m
            pos[r, col: col + n] = np.arange(n)
            doc[r, col: col + n] = d
            col += n
        real += col
    return Batch(
        seq=seq, batch_id=batch_id, epoch=epoch,
        input_ids=torch.from_numpy(ids), loss_mask=torch.from_numpy(mask),
        position_ids=torch.from_numpy(pos), doc_ids=torch.from_numpy(doc),
        num_tokens=real, num_padding=b * t - real,
    )


class Sampler:
    """Yields Batches of ``dataset`` epoch after epoch in the order ``cfg.strategy`` defines.

    Args:
        dataset: the (training) dataset.
        cfg: data config; uses strategy, batch_size, tokens_per_batch, packed_rows, num_buckets,
            pack_window, seed.
        pad_id: token id written on padding (``tokenizer_info(tok).pad_token_id``).
        max_epochs: stop after this many epochs (None = forever).
        max_batches: stop when the global batch id reaches this (None = forever); counts across
            resumes, so a resumed run stops at the same batch.

    Raises:
        DataError: the dataset is empty.
    """

    def __init__(self, dataset: TokenizedDataset, cfg: DataConfig, *, pad_id: int,
                 max_epochs: int | None = None, max_batches: int | None = None) -> None:
        if len(dataset) == 0:
            raise DataError("the training dataset is empty; check data.source and data.holdout")
        self.dataset = dataset
        self.cfg = cfg
        self.pad_id = pad_id
        self.max_epochs = max_epochs
        self.max_batches = max_batches
        self.epoch = 0
        self.index = 0
        self.batch_id = 0
        self.seq = 0  # position in this run's stream; restarts at 0 on resume by design
        self._plan_epoch = -1
        self._plan: list[PlannedBatch] = []

    def plan(self, epoch: int) -> list[PlannedBatch]:
        """The batch plan of ``epoch`` (a pure function of the dataset, settings, seed, epoch)."""
        if epoch != self._plan_epoch:
            c, lengths = self.cfg, self.dataset.lengths
            rng = epoch_rng(c.seed, epoch)
            if c.strategy == "sorted":
                self._plan = plan_sorted(lengths, c.batch_size)
            elif c.strategy == "random":
                self._plan = plan_random(lengths, c.batch_size, rng)
            elif c.strategy == "bucketed":
                self._plan = plan_bucketed(lengths, c.batch_size, c.num_buckets, rng)
            else:
                self._plan = plan_packed(lengths, c.pack_length, c.packed_rows, c.pack_window, rng)
            self._plan_epoch = epoch
        return self._plan

    def epoch_stats(self, epoch: int = 0) -> BatchingStats:
        """Padding waste and diversity of ``epoch`` (see :func:`dflash.data.batching.plan_stats`)."""
        return plan_stats(self.cfg.strategy, self.dataset.lengths, self.plan(epoch))

    def __iter__(self) -> "Sampler":
        return self

    def __next__(self) -> Batch:
        if self.max_batches is not None and self.batch_id >= self.max_batches:
            raise StopIteration
        if self.index >= len(self.plan(self.epoch)):  # plans are never empty
            self.epoch, self.index = self.epoch + 1, 0
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise StopIteration
        pb = self.plan(self.epoch)[self.index]
        batch = collate(self.dataset, pb, self.pad_id, seq=self.seq, batch_id=self.batch_id, epoch=self.epoch)
        self.index += 1
        self.batch_id += 1
        self.seq += 1
        batch.sampler_state = self.state_dict()
        return batch

    def _settings(self) -> dict[str, Any]:
        c = self.cfg
        return {"strategy": c.strategy, "seed": c.seed, "batch_size": c.batch_size,
                "tokens_per_batch": c.tokens_per_batch, "packed_rows": c.packed_rows,
                "num_buckets": c.num_buckets, "pack_window": c.pack_window,
                "dataset": self.dataset.fingerprint}

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, index, batch_id) plus the settings it is valid for; JSON-able."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "index": self.index,
                "batch_id": self.batch_id, **self._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` or ``Batch.sampler_state``).

        Raises:
            DataError: the state was saved with other settings or another dataset (the message
                names the differing keys); resume with the same ``[data]`` settings.
        """
        if state.get("version") != STATE_VERSION:
            raise DataError(f"sampler state version {state.get('version')!r} is not {STATE_VERSION}")
        mine = self._settings()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise DataError(f"cannot resume the data order: {what}; resume with the same [data] "
                            "settings and data, or start without resuming")
        self.epoch, self.index, self.batch_id = int(state["epoch"]), int(state["index"]), int(state["batch_id"])
