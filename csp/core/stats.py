"""Statistics records reported by channels and processes (frozen msgspec Structs).

Both are plain values: cheap to build, safe to hand to another thread, and encodable with
``msgspec.json.encode`` / ``msgspec.structs.asdict`` for ``stats.jsonl``.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class ChannelStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one channel, the same from either end (``end.statistics()``).

    Attributes:
        name: the channel's name ('' if unnamed).
        capacity: buffer size in items; 0 for a rendezvous channel.
        current_fill: items in the buffer now (can exceed ``capacity`` by the number of receivers
            that were woken for an item and have not taken it yet).
        peak_fill: the largest ``current_fill`` seen so far.
        open_send_ends: send ends (including clones) not yet closed.
        open_receive_ends: receive ends (including clones) not yet closed.
        waiting_senders: send calls blocked right now.
        waiting_receivers: receive calls blocked right now.
        items_moved: items received so far.
        bytes_moved: bytes of the items received so far (tensor ``nbytes`` walked through Structs,
            dicts, lists and tuples; ``__csp_nbytes__()`` for other objects; else 0).
        send_blocked_s: total seconds send calls spent blocked (including calls blocked now).
        receive_wait_s: total seconds receive calls spent waiting (including calls waiting now).
    """

    name: str
    capacity: int
    current_fill: int
    peak_fill: int
    open_send_ends: int
    open_receive_ends: int
    waiting_senders: int
    waiting_receivers: int
    items_moved: int
    bytes_moved: int
    send_blocked_s: float
    receive_wait_s: float


ProcessState = Literal["setup", "busy", "waiting_input", "blocked_output", "done", "failed"]


class ProcessStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one process replica, built by the runtime from the channel ends it owns.

    Attributes:
        qualname: ``name[replica]``, e.g. ``"target[1]"``.
        name: the process name in the graph.
        replica: replica index (0-based).
        state: what the replica is doing now: "setup", "busy", "waiting_input" (blocked in a
            receive), "blocked_output" (blocked in a send), "done" or "failed".
        busy_s: seconds alive minus ``wait_input_s`` and ``blocked_output_s``.
        wait_input_s: total seconds its receive ends spent waiting for an item.
        blocked_output_s: total seconds its send ends spent blocked on a full channel.
        items_in: items received through its receive ends.
        items_out: items sent through its send ends.
    """

    qualname: str
    name: str
    replica: int
    state: ProcessState
    busy_s: float
    wait_input_s: float
    blocked_output_s: float
    items_in: int
    items_out: int


__all__ = ["ChannelStatistics", "ProcessState", "ProcessStatistics"]
