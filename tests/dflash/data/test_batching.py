"""dflash.data batching strategies and the resumable Sampler."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from dflash.data import (
    DataConfig,
    DataError,
    Sampler,
    TokenizedDataset,
    collate,
    plan_stats,
)
from dflash.data.batching import epoch_rng, plan_bucketed, plan_packed, plan_sorted
from dflash.messages import Batch
from dflash.train.anchors import sample_anchors

STRATEGIES = ["sorted", "random", "bucketed", "packed"]
PAD = 0


def make_dataset(lengths, seed=0) -> TokenizedDataset:
    """Conversation i holds tokens 1000*i + 1, 1000*i + 2, ... (so every token names its source),
    with a loss mask on every other token."""
    ids = [[1000 * i + j + 1 for j in range(n)] for i, n in enumerate(lengths)]
    masks = [[j % 2 for j in range(n)] for n in lengths]
    return TokenizedDataset.from_sequences(ids, masks, key=f"test-{seed}")


def spread_lengths(n=120, seed=0) -> list[int]:
    return np.random.default_rng(seed).integers(2, 200, size=n).tolist()


def cfg(strategy, **kw) -> DataConfig:
    base = {"strategy": strategy, "batch_size": 4, "tokens_per_batch": 256, "num_buckets": 4, "seed": 7}
    return DataConfig(**{**base, **kw})


def epoch_batches(sampler: Sampler) -> list[Batch]:
    first = next(sampler)
    out = [first]
    while sampler.index < len(sampler.plan(first.epoch)):
        out.append(next(sampler))
    return out


def check_batch_layout(b: Batch, ds: TokenizedDataset) -> set[int]:
    """Shapes/dtypes, doc spans, position restarts and padding; returns the conversations seen."""
    B, T = b.input_ids.shape
    assert b.input_ids.dtype == torch.int64 and b.loss_mask.dtype == torch.bool
    assert b.position_ids.dtype == torch.int64 and b.doc_ids.dtype == torch.int32
    assert b.loss_mask.shape == b.position_ids.shape == b.doc_ids.shape == (B, T)
    pad = b.doc_ids == -1
    assert int(pad.sum()) == b.num_padding and b.num_tokens + b.num_padding == B * T
    assert (b.input_ids[pad] == PAD).all() and not b.loss_mask[pad].any() and (b.position_ids[pad] == 0).all()
    seen = set()
    for r in range(B):
        docs = b.doc_ids[r]
        for d in docs[docs >= 0].unique().tolist():
            cols = (docs == d).nonzero().flatten()
            assert cols.tolist() == list(range(cols[0], cols[-1] + 1)), "doc span must be contiguous"
            toks = b.input_ids[r, cols]
            conv = int(toks[0]) // 1000
            assert (toks // 1000 == conv).all(), "a doc_id span mixes two conversations"
            start = int(toks[0]) % 1000 - 1
            assert b.position_ids[r, cols].tolist() == list(range(len(cols))), "positions restart at 0"
            ref_ids, ref_mask = ds.span(conv, start, start + len(cols))
            assert toks.tolist() == ref_ids.tolist()
            assert b.loss_mask[r, cols].tolist() == ref_mask.astype(bool).tolist()
            seen.add(conv)
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_covers_every_conversation_once_per_epoch(strategy):
    ds = make_dataset(spread_lengths())
    batches = epoch_batches(Sampler(ds, cfg(strategy), pad_id=PAD))
    seen: list[int] = []
    for b in batches:
        seen += sorted(check_batch_layout(b, ds))
    assert sorted(seen) == list(range(len(ds)))
    assert sum(b.num_tokens for b in batches) == int(ds.lengths.sum())


def test_padding_waste_exact_on_hand_computed_case():
    ds = make_dataset([5, 1, 10, 3, 2, 4])
    s = Sampler(ds, cfg("sorted", batch_size=2), pad_id=PAD)
    # sorted: (1,2) -> T=2, (3,4) -> T=4, (5,10) -> T=10: computed 4+8+20 = 32, real 25
    batches = epoch_batches(s)
    assert [tuple(b.input_ids.shape) for b in batches] == [(2, 2), (2, 4), (2, 10)]
    assert sum(b.num_padding for b in batches) == 7
    st = s.epoch_stats(0)
    assert (st.num_tokens, st.num_padding, st.padding_waste) == (25, 7, 7 / 32)

    packed = Sampler(make_dataset([5, 5, 3]), cfg("packed", tokens_per_batch=8), pad_id=PAD)
    st = packed.epoch_stats(0)  # rows: [5,3] and [5] -> 16 computed, 13 real
    assert (st.num_batches, st.num_padding, st.padding_waste) == (2, 3, 3 / 16)

    # three full rows of 8, two rows per batch: the second batch is one row + one empty filler row
    filled = Sampler(make_dataset([8, 8, 8]), cfg("packed", tokens_per_batch=16, packed_rows=2), pad_id=PAD)
    st = filled.epoch_stats(0)
    assert (st.num_batches, st.num_tokens, st.num_padding, st.padding_waste) == (2, 24, 8, 8 / 32)
    assert st.mean_batch_tokens == 16
    assert [b.num_padding for b in epoch_batches(filled)] == [0, 8]


def test_packed_rows_documents_whole_and_long_ones_split():
    lengths = [3, 9, 4, 20, 1]
    plan = plan_packed(np.array(lengths), pack_length=8, packed_rows=2, window=4, rng=epoch_rng(0, 0))
    for pb in plan:
        assert pb.width == 8 and len(pb.rows) == 2
        for row in pb.rows:
            assert sum(stop - start for _, start, stop in row) <= 8
    pieces = sorted((d, a, b) for pb in plan for row in pb.rows for d, a, b in row)
    assert pieces == [(0, 0, 3), (1, 0, 8), (1, 8, 9), (2, 0, 4), (3, 0, 8), (3, 8, 16), (3, 16, 20), (4, 0, 1)]
    ds = make_dataset(lengths)
    s = Sampler(ds, cfg("packed", tokens_per_batch=16, packed_rows=2, pack_window=4), pad_id=PAD)
    for b in epoch_batches(s):
        assert b.input_ids.shape[1] == 8
        check_batch_layout(b, ds)


@pytest.mark.parametrize("packed_rows", [2, 3, 4, 5])
def test_packed_batches_all_have_packed_rows_rows(packed_rows):
    """Invariant: a compiled stage sees one shape all epoch: every packed batch, the last one too,
    is [packed_rows, pack_length] (filler rows fill the last batch)."""
    lengths = spread_lengths(97, seed=4)
    ds = make_dataset(lengths)
    c = cfg("packed", tokens_per_batch=240 * packed_rows, packed_rows=packed_rows, pack_window=3)
    s = Sampler(ds, c, pad_id=PAD)
    short = 0
    for epoch in range(4):
        plan = s.plan(epoch)
        assert all(len(pb.rows) == packed_rows and pb.width == c.pack_length for pb in plan)
        short += any(row == [] for row in plan[-1].rows)
        assert all(row for pb in plan[:-1] for row in pb.rows)     # filler only in the last batch
    assert short > 0, "no epoch needed filler rows: the test does not exercise the last batch"
    assert {tuple(b.input_ids.shape) for b in epoch_batches(s)} == {(packed_rows, c.pack_length)}


def test_packed_filler_rows_are_padding_only():
    ds = make_dataset([8, 8, 8, 5, 7])  # window 1: five rows (5 and 7 never share), 4 per batch
    c = cfg("packed", tokens_per_batch=32, packed_rows=4, pack_window=1)
    s = Sampler(ds, c, pad_id=PAD)
    plan = s.plan(0)
    n_real = sum(1 for pb in plan for row in pb.rows if row)
    assert n_real == 5 and len(plan) == 2 and plan[-1].rows[1:] == [[], [], []]
    last = epoch_batches(s)[-1]
    check_batch_layout(last, ds)
    assert last.input_ids.shape == (4, 8)
    fill = slice(1, None)
    assert (last.doc_ids[fill] == -1).all() and not last.loss_mask[fill].any()
    assert (last.input_ids[fill] == PAD).all() and (last.position_ids[fill] == 0).all()
    assert last.num_tokens == int(last.doc_ids[0].ge(0).sum()) and last.num_padding == 32 - last.num_tokens
    anchors = sample_anchors(last.loss_mask, last.doc_ids, 6, 3, torch.Generator().manual_seed(0))
    assert (anchors[fill] == -1).all() and (anchors[0] >= 0).any()
    st = s.epoch_stats(0)  # the filler rows are computed tokens, all padding
    assert (st.num_tokens, st.num_padding) == (36, 2 * 32 - 36)


def test_bucketed_consecutive_batches_come_from_different_buckets():
    lengths = np.array(spread_lengths(400, seed=1))
    for epoch in range(5):
        plan = plan_bucketed(lengths, 4, 5, epoch_rng(3, epoch))
        buckets = [pb.bucket for pb in plan]
        assert sorted(set(buckets)) == [0, 1, 2, 3, 4]
        for i in range(len(buckets) - 1):
            if buckets[i] == buckets[i + 1]:  # only once every other bucket is exhausted
                assert set(buckets[i:]) == {buckets[i]}
        # buckets are length ranges: every conversation of bucket b is no longer than any of b+1
        by_bucket = {b: [] for b in range(5)}
        for pb in plan:
            by_bucket[pb.bucket] += [lengths[d] for row in pb.rows for d, _, _ in row]
        for b in range(4):
            assert max(by_bucket[b]) <= min(by_bucket[b + 1])


def test_diversity_statistic_exposes_homogeneous_batches():
    ds = make_dataset(spread_lengths(400, seed=2))
    st = {s: Sampler(ds, cfg(s, tokens_per_batch=512), pad_id=PAD).epoch_stats(0) for s in STRATEGIES}
    assert st["random"].diversity > 0.7 and st["packed"].diversity > 0.7
    assert st["sorted"].diversity < 0.1 and st["bucketed"].diversity < 0.4
    assert st["sorted"].order_autocorr > 0.9 and abs(st["random"].order_autocorr) < 0.3
    assert st["packed"].padding_waste < st["bucketed"].padding_waste < st["random"].padding_waste
    assert st["sorted"].padding_waste < st["random"].padding_waste


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_order_is_a_pure_function_of_seed_and_epoch(strategy):
    ds = make_dataset(spread_lengths())
    a, b = Sampler(ds, cfg(strategy), pad_id=PAD), Sampler(ds, cfg(strategy), pad_id=PAD)
    plan = lambda s, e: [[tuple(x) for row in pb.rows for x in row] for pb in s.plan(e)]  # noqa: E731
    assert plan(a, 1) == plan(b, 1) and plan(a, 0) == plan(b, 0)
    assert plan(a, 2) == plan(Sampler(ds, cfg(strategy), pad_id=PAD), 2)  # epoch 2 without 0 and 1
    if strategy != "sorted":
        assert plan(a, 0) != plan(a, 1)
        assert plan(a, 0) != plan(Sampler(ds, cfg(strategy, seed=8), pad_id=PAD), 0)
    else:
        assert plan(a, 0) == plan(a, 1) == plan_sorted_flat(ds)


def plan_sorted_flat(ds):
    return [[tuple(x) for row in pb.rows for x in row] for pb in plan_sorted(ds.lengths, 4)]


def same_batch(x: Batch, y: Batch) -> None:
    assert (x.batch_id, x.epoch) == (y.batch_id, y.epoch)
    for f in ("input_ids", "loss_mask", "position_ids", "doc_ids"):
        assert torch.equal(getattr(x, f), getattr(y, f)), f
    assert x.sampler_state == y.sampler_state


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_sees_exactly_the_uninterrupted_batches(strategy):
    """Invariant: restoring Batch.sampler_state (through JSON) continues the same stream, across
    epoch boundaries, with seq restarting at 0 in the resumed run."""
    ds = make_dataset(spread_lengths(30))
    full = Sampler(ds, cfg(strategy), pad_id=PAD)
    per_epoch = len(full.plan(0))
    stream = [next(full) for _ in range(3 * per_epoch + 2)]
    for cut in (0, per_epoch - 1, per_epoch, 2 * per_epoch + 1):
        state = json.loads(json.dumps(stream[cut].sampler_state))
        resumed = Sampler(ds, cfg(strategy), pad_id=PAD)
        resumed.load_state_dict(state)
        rest = [next(resumed) for _ in range(len(stream) - cut - 1)]
        assert [b.seq for b in rest[:2]] == [0, 1]
        for x, y in zip(rest, stream[cut + 1:]):
            same_batch(x, y)


def test_resume_with_other_settings_is_refused():
    ds = make_dataset(spread_lengths(30))
    state = next(Sampler(ds, cfg("packed"), pad_id=PAD)).sampler_state
    with pytest.raises(DataError, match="strategy: saved 'packed', now 'random'"):
        Sampler(ds, cfg("random"), pad_id=PAD).load_state_dict(state)
    with pytest.raises(DataError, match="dataset"):
        Sampler(make_dataset(spread_lengths(31)), cfg("packed"), pad_id=PAD).load_state_dict(state)


def test_bounded_iteration():
    ds = make_dataset([5, 6, 7, 8, 9])
    per_epoch = len(Sampler(ds, cfg("random", batch_size=2), pad_id=PAD).plan(0))
    assert per_epoch == 3
    assert [b.epoch for b in Sampler(ds, cfg("random", batch_size=2), pad_id=PAD, max_epochs=2)] == [0] * 3 + [1] * 3
    s = Sampler(ds, cfg("random", batch_size=2), pad_id=PAD, max_batches=4)
    assert [b.batch_id for b in s] == [0, 1, 2, 3]
    with pytest.raises(DataError, match="empty"):
        Sampler(make_dataset([]), cfg("random"), pad_id=PAD)


def test_collate_single_padded_row_and_stats_on_plan():
    ds = make_dataset([3, 5])
    plan = plan_sorted(ds.lengths, 2)
    b = collate(ds, plan[0], pad_id=9, seq=4, batch_id=11, epoch=2)
    assert (b.seq, b.batch_id, b.epoch, b.num_tokens, b.num_padding) == (4, 11, 2, 8, 2)
    assert b.input_ids[0].tolist() == [1, 2, 3, 9, 9]
    assert b.doc_ids[0].tolist() == [0, 0, 0, -1, -1]
    st = plan_stats("sorted", ds.lengths, plan)
    assert msgspec.to_builtins(st)["padding_waste"] == 0.2
