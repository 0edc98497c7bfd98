"""Peer liveness on the control plane (csp.distributed.control): a rank whose heartbeat stops is
reported lost, by name, within a bounded time, and a rank that keeps beating is not."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from csp.distributed.control import Control


def _watch(control: Control) -> tuple[threading.Event, list[tuple[int, str]]]:
    fired, got = threading.Event(), []

    def on_abort(rank: int, message: str) -> None:
        got.append((rank, message))
        fired.set()

    control.watch(on_abort, interval_s=0.01)
    return fired, got


def test_a_silent_rank_is_reported_lost_within_the_peer_timeout():
    """Invariant: a host that vanishes without closing its sockets (no gloo error ever comes)
    still ends the run within ``peer_timeout_s`` plus one beat, naming the silent rank."""
    store = dist.HashStore()
    ranks = [Control(store, r, 3, peer_timeout_s=0.4) for r in range(3)]
    watched = [_watch(c) for c in ranks[:2]]  # rank 2 never beats: its host is gone
    t0 = time.monotonic()
    try:
        for fired, _ in watched:
            assert fired.wait(5.0), "the silent rank was never reported"
        elapsed = time.monotonic() - t0
    finally:
        for c in ranks:
            c.stop()
    assert 0.4 <= elapsed < 2.0
    for _, got in watched:
        assert got == [(2, "rank 2 stopped answering: no heartbeat for 0.4 s (its host lost?)")]
    assert ranks[0].seen == ranks[1].seen == got[0]


def test_ranks_that_keep_beating_are_not_reported():
    store = dist.HashStore()
    ranks = [Control(store, r, 2, peer_timeout_s=0.3) for r in range(2)]
    watched = [_watch(c) for c in ranks]
    try:
        assert not any(fired.wait(1.0) for fired, _ in watched)
    finally:
        for c in ranks:
            c.stop()
    assert all(c.seen is None for c in ranks)


def test_peer_timeout_zero_turns_the_heartbeat_off_and_negative_is_refused():
    store = dist.HashStore()
    quiet = Control(store, 0, 2, peer_timeout_s=0)
    fired, _ = _watch(quiet)
    try:
        assert not fired.wait(0.5)
    finally:
        quiet.stop()
    assert not store.check(["csp.distributed/beat/0"])
    with pytest.raises(ValueError, match=r"peer_timeout_s must be >= 0 seconds \(0 = no heartbeat\), got -1"):
        Control(store, 0, 2, peer_timeout_s=-1)


def test_a_connection_failure_names_the_rank_that_went_silent():
    """Invariant: when this rank fails with a lost-connection error (the socket broke before the
    heartbeat timed out), the published cause names the rank whose heartbeat stopped, not the
    socket; with every peer still beating the message is published as it was, as this rank's."""
    store = dist.HashStore()
    ranks = [Control(store, r, 3, peer_timeout_s=60) for r in range(3)]
    for c in ranks[:2]:
        _watch(c)  # ranks 0 and 1 beat; rank 2's host is gone
    gloo = "rank 0: process drafter[0] failed: RuntimeError('Read error [127.0.0.1]:60040: Connection reset by peer')"
    try:
        rank, message = ranks[0].report(gloo)
    finally:
        for c in ranks:
            c.stop()
    assert rank == 2 and message.startswith("rank 2 stopped answering (its host lost?)") and gloo in message

    store = dist.HashStore()
    ranks = [Control(store, r, 2, peer_timeout_s=60) for r in range(2)]
    for c in ranks:
        _watch(c)
    try:
        rank, message = ranks[0].report(gloo)
        other = ranks[0].report("rank 0: ValueError('bad batch')")  # no probe: not a connection error
    finally:
        for c in ranks:
            c.stop()
    assert (rank, message) == (0, gloo) and other == (0, gloo)  # the first failure stays the cause
