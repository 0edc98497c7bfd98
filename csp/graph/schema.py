"""The graph file's TOML schema: ``[[channel]]``, ``[[process]]``, ``[trace]``, ``[runtime]`` and
``plugins``.

msgspec Structs with unknown keys forbidden and limits in the types, so a typo or a bad value is a
``msgspec.ValidationError`` with its path (``$.channel[0].capacity``); :func:`csp.graph.load_spec`
turns it into a :class:`csp.GraphError` naming the file.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from csp.core.strict import Strict

Name = Annotated[str, Meta(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$")]

MAX_REPLICAS = 4096
"""Most replicas one ``[[process]]`` may have: each is a thread or task of its own (or one rank
under torchrun), and a value beyond that is a typo, refused at load rather than by the OS when
the threads start."""


class ChannelSpec(Strict):
    """One ``[[channel]]``: a bounded, typed channel.

    Attributes:
        name: unique channel name; ports refer to it.
        capacity: buffer size in items; 0 is a rendezvous. Required: there is no unbounded channel.
        ordered: deliver items in ``seq`` order (ordered fan-in after replicas). One process
            (any number of its replicas) and one port may send to it: it restores one seq stream,
            so its seqs must also trace back to one origin upstream (one source with one replica,
            or a process declaring ``seq_origin = True``; ``csp.graph.validation.seq_origins``).
        rank_local: under torch.distributed (``csp.distributed``), every rank gets its own copy of this
            channel: items never leave the rank they were sent on. Ignored in a single process.
    """

    name: Name
    capacity: Annotated[int, Meta(ge=0)]
    ordered: bool = False
    rank_local: bool = False


class ProcessSpec(Strict):
    """One ``[[process]]``: a process kind, its replicas, devices and port wiring.

    Attributes:
        name: unique process name (replicas are ``name[0]``, ``name[1]``, ...).
        kind: registry kind of the Process class.
        replicas: number of instances, 1 .. :data:`MAX_REPLICAS`.
        device: one device for every replica ("cpu", "cuda:N", or "cuda", which means "cuda:0" and
            is accepted for a single replica only: for several, write "cuda:0" to put them all on
            GPU 0, or ``devices``); omitted = no device (CPU).
        devices: one device per replica ("cuda" = "cuda:0"); exclusive with ``device``.
        inputs: port name -> channel name.
        outputs: port name -> channel name.
        options: decoded by the kind's ``Options`` Struct (unknown keys rejected).
        ranks: under torch.distributed (``csp.distributed``), the rank of each replica (one per replica);
            omitted = the default placement (docs/distributed.md). Ignored in a single process.
    """

    name: Name
    kind: Annotated[str, Meta(min_length=1)]
    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] = 1
    device: str | None = None
    devices: list[str] | None = None
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    options: dict[str, Any] = {}
    ranks: list[Annotated[int, Meta(ge=0)]] | None = None


class TraceSpec(Strict):
    """``[trace]``: observability knobs.

    Attributes:
        stats_interval_s: period of ``RUN_DIR/csp/stats.jsonl`` snapshots and trace counters, in s.
        perfetto: write ``RUN_DIR/csp/trace.json`` (process spans, channel fill counters).
        flows: add flow arrows following sampled items across the graph.
        flow_every: with ``flows``, follow every N-th item sent by each source replica.
        max_events: cap on buffered trace events; later events are dropped and counted.
    """

    stats_interval_s: Annotated[float, Meta(gt=0)] = 1.0
    perfetto: bool = True
    flows: bool = False
    flow_every: Annotated[int, Meta(ge=1)] = 100
    max_events: Annotated[int, Meta(ge=0)] = 1_000_000


class RuntimeSpec(Strict):
    """``[runtime]``: how the runtime supervises a run.

    Attributes:
        deadlock_timeout_s: stop the run as deadlocked once every live process has been waiting
            inside a channel call (a blocked send or receive) with no item moving anywhere for
            this many seconds, in s; 0 turns the check off. A process computing, sleeping or
            polling outside channel calls is not waiting, so it never counts towards a deadlock.
            Checked only when one runtime runs the whole graph (not per rank under ``csp.distributed``,
            where a peer on another rank may be busy).
    """

    deadlock_timeout_s: Annotated[float, Meta(ge=0)] = 30.0


class GraphSpec(Strict):
    """A whole graph file. Applications subclass it to add their own tables.

    Attributes:
        plugins: modules imported before kinds are resolved (their ``@csp.register`` runs).
        channel: the ``[[channel]]`` tables.
        process: the ``[[process]]`` tables.
        trace: the ``[trace]`` table.
        runtime: the ``[runtime]`` table.
    """

    plugins: list[str] = []
    channel: list[ChannelSpec] = []
    process: list[ProcessSpec] = []
    trace: TraceSpec = msgspec.field(default_factory=TraceSpec)
    runtime: RuntimeSpec = msgspec.field(default_factory=RuntimeSpec)


__all__ = ["MAX_REPLICAS", "ChannelSpec", "GraphSpec", "Name", "ProcessSpec", "RuntimeSpec", "TraceSpec"]
