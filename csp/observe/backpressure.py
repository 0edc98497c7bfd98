"""Backpressure analysis of a csp run: read ``RUN_DIR/csp/stats.jsonl``, summarise, find the bottleneck.

The stats log is read by :mod:`csp.observe.stats_reader` (:class:`StatsReader`, :func:`read_stats`, re-exported
here). Every number here is a difference of
two records (the *baseline*, by default the run start where all counters are 0, and the latest
record) divided by the elapsed seconds between them, so a finished run and a live one (``--follow``)
are analysed the same way, and ``window_s`` restricts the analysis to the last seconds of a run.

Normalisation (all fractions are in [0, 1]):

* channel ``send_blocked_frac`` = (send-blocked seconds) / (elapsed seconds x number of send ends),
  ``receive_wait_frac`` likewise with the receive ends. The number of ends is the sum of the
  replicas of the processes that write (read) the channel in the graph header, so 0.5 means "an
  average sender replica spent half of the wall time blocked on this channel".
* process fractions are seconds / alive seconds (``busy_s + wait_input_s + blocked_output_s``), so
  busy + waiting + blocked = 1 for every replica that has run at all, and a replica that finished
  early is not diluted by the time after it finished. Aggregates per process name sum the seconds
  of its replicas before dividing.
* ``fill_avg`` is the mean of the sampled ``current_fill`` values in the window (samples are
  evenly spaced, one per ``stats_interval_s``).

The bottleneck rule (:func:`find_bottleneck`): in a pipeline of bounded channels at steady state
the slowest stage is busy nearly all the time, the stages upstream of it are blocked on output
(its input channels are full) and the stages downstream wait for input (its output channels are
empty). Each process name ``P`` gets the score ``mean(busy, up, down)`` where ``busy`` is the
largest busy fraction among its replicas, ``up`` the largest ``send_blocked_frac`` of its input
channels (omitted for a source) and ``down`` the largest ``receive_wait_frac`` of its output
channels (omitted for a sink). The highest score wins. So a slow source (everyone downstream
waits) and a slow sink (everyone upstream blocked) are judged on the evidence they have. Within
the winner, a replica whose busy fraction exceeds its siblings' median by 0.25, or whose output
rate is below half of theirs, is named as the slow replica (``target[2]``). If the best stage is
busy less than half the time, no stage is clearly the bottleneck and the verdict says so.

Head-of-line blocking (:func:`head_of_line`): an *ordered* channel delivers items in sequence, so
its receivers can wait while later items sit in its buffer: the next item in sequence is late, and
every stage around it waits for the one replica that holds it. An unordered channel cannot do
that (a receiver waits only on an empty buffer). Its evidence is ``head_of_line_frac``, the
fraction of samples in which the channel had a waiting receiver *and* buffered items. When the
samples do not show it (a receiver that is an async task is rarely caught parked), the averages
bound it from below: receivers waited ``receive_wait_frac`` of the time and the buffer was
non-empty at least ``fill_avg / capacity`` of it, so both held at least
``receive_wait_frac + fill_avg / capacity - 1`` of it. An ordered channel whose sampled fraction
reaches ``HOL_FLOOR`` (0.2) is the verdict, ahead of the stage rule; one whose bound reaches it is
the verdict when no stage is clearly busy, or when the busy stage is the channel's writer. The verdict names the channel, and the writer replica
that holds the sequence when one stands out by the slow-replica rule above (it is the bottleneck
then); otherwise it says the late item moves between the writer's replicas.
"""

from __future__ import annotations

import statistics

import msgspec

from csp.errors import StatsFormatError
from csp.observe.stats_reader import ChannelInfo, GraphInfo, ProcessInfo, Sample, StatsReader, read_stats, stats_path
from csp.observe.units import rate

BUSY_FLOOR = 0.5  # below this busy fraction no stage is called the bottleneck
REPLICA_BUSY_MARGIN = 0.25  # a replica this much busier than its siblings' median is "the slow one"
REPLICA_RATE_RATIO = 0.5  # ... or one whose items_out rate is below this fraction of theirs
HOL_FLOOR = 0.2  # head-of-line evidence (fraction of the time) that makes an ordered channel the verdict




class ChannelSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One channel over the analysed window. Fractions in [0, 1]; rates per second of wall time."""

    name: str
    capacity: int
    writers: list[str]
    readers: list[str]
    fill_now: int
    fill_avg: float
    fill_peak: int
    send_blocked_frac: float
    receive_wait_frac: float
    items_per_s: float
    bytes_per_s: float
    ordered: bool = False
    head_of_line_frac: float = 0.0
    """Fraction of the window's samples with a waiting receiver and buffered items (only an
    ordered channel can show it: the next item in sequence is late)."""


class ReplicaSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One process replica over the window; the three fractions sum to 1 (0 if never alive)."""

    qualname: str
    name: str
    replica: int
    state: str
    alive_s: float
    busy_frac: float
    wait_input_frac: float
    blocked_output_frac: float
    items_in_per_s: float
    items_out_per_s: float


class ProcessSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A process name: its replicas' seconds summed, then divided by their summed alive seconds."""

    name: str
    replicas: list[ReplicaSummary]
    busy_frac: float
    wait_input_frac: float
    blocked_output_frac: float
    items_in_per_s: float
    items_out_per_s: float
    devices: list[str | None] = []
    """Its replicas' devices from the graph header ("cpu", "cuda:N", None: not bound)."""


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """``text`` starts with ``bottleneck:`` (or ``deadlock:`` for a run the runtime stopped as
    deadlocked, ``deadlock`` True); ``stage`` is None when no stage is clearly the cause;
    ``channel`` names an ordered channel found head-of-line blocked."""

    text: str
    stage: str | None = None
    replica: str | None = None
    score: float = 0.0
    channel: str | None = None
    deadlock: bool = False


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``python -m csp.inspect`` shows; encodes to JSON with ``msgspec.json.encode``."""

    t_start: float
    t_end: float
    elapsed_s: float
    samples: int
    status: str | None
    exit_code: int | None
    channels: list[ChannelSummary]
    processes: list[ProcessSummary]
    verdict: Verdict
    host_cpus: int = 0
    """The CPU count of the machine it ran on (0: not recorded)."""


def _frac(num: float, den: float) -> float:
    return min(max(num / den, 0.0), 1.0) if den > 0 else 0.0


def _ends(procs: list[ProcessInfo]) -> int:
    return sum(p.replicas for p in procs)


def summarize(log: StatsReader, window_s: float | None = None) -> Summary:
    """Summarise ``log`` from its start (or the last ``window_s`` seconds) to its latest record."""
    if not log.samples:
        return Summary(t_start=0.0, t_end=0.0, elapsed_s=0.0, samples=0, status=None,
                       exit_code=None, channels=[], processes=[],
                       verdict=Verdict(text="bottleneck: unknown (no stats snapshot yet)"))
    end = log.samples[-1]
    base: Sample | None = None
    if window_s is not None:
        older = [s for s in log.samples if s.t <= end.t - window_s]
        base = older[-1] if older else None
    t_start = base.t if base else 0.0
    window = [s for s in log.samples if s.t > t_start]
    dt = end.t - t_start
    graph = log.graph

    channels = []
    names = [c.name for c in graph.channels] + sorted(set(end.channels) - {c.name for c in graph.channels})
    capacities = {c.name: c.capacity for c in graph.channels}
    ordered = {c.name for c in graph.channels if c.ordered}
    for name in names:
        now = end.channels.get(name)
        if now is None:
            continue
        b = base.channels.get(name) if base else None
        writers, readers = graph.writers(name), graph.readers(name)
        n_send = _ends(writers) or max(s.channels[name].open_send_ends for s in window if name in s.channels) or 1
        n_recv = _ends(readers) or max(s.channels[name].open_receive_ends for s in window if name in s.channels) or 1
        snaps = [s.channels[name] for s in window if name in s.channels] or [now]
        fills = [c.current_fill for c in snaps]
        hol = sum(1 for c in snaps if c.waiting_receivers > 0 and c.current_fill > 0) / len(snaps)
        channels.append(ChannelSummary(
            name=name, capacity=capacities.get(name, now.capacity),
            writers=[p.name for p in writers], readers=[p.name for p in readers],
            fill_now=now.current_fill,
            fill_avg=sum(fills) / len(fills),
            fill_peak=now.peak_fill if base is None else max(fills),
            send_blocked_frac=_frac(now.send_blocked_s - (b.send_blocked_s if b else 0.0), dt * n_send),
            receive_wait_frac=_frac(now.receive_wait_s - (b.receive_wait_s if b else 0.0), dt * n_recv),
            items_per_s=(now.items_moved - (b.items_moved if b else 0)) / dt if dt > 0 else 0.0,
            bytes_per_s=(now.bytes_moved - (b.bytes_moved if b else 0)) / dt if dt > 0 else 0.0,
            ordered=name in ordered, head_of_line_frac=hol,
        ))

    order = [p.name for p in graph.processes]
    devices = {p.name: list(p.devices) for p in graph.processes}
    by_name: dict[str, list[ReplicaSummary]] = {}
    for qualname, now in sorted(end.processes.items(), key=lambda kv: (kv[1].name, kv[1].replica)):
        b = base.processes.get(qualname) if base else None
        busy = now.busy_s - (b.busy_s if b else 0.0)
        wait = now.wait_input_s - (b.wait_input_s if b else 0.0)
        blocked = now.blocked_output_s - (b.blocked_output_s if b else 0.0)
        alive = busy + wait + blocked
        by_name.setdefault(now.name, []).append(ReplicaSummary(
            qualname=qualname, name=now.name, replica=now.replica, state=now.state, alive_s=alive,
            busy_frac=_frac(busy, alive), wait_input_frac=_frac(wait, alive),
            blocked_output_frac=_frac(blocked, alive),
            items_in_per_s=(now.items_in - (b.items_in if b else 0)) / dt if dt > 0 else 0.0,
            items_out_per_s=(now.items_out - (b.items_out if b else 0)) / dt if dt > 0 else 0.0,
        ))
    processes = []
    for name in sorted(by_name, key=lambda n: (order.index(n) if n in order else len(order), n)):
        reps = by_name[name]
        alive = sum(r.alive_s for r in reps)
        processes.append(ProcessSummary(
            name=name, replicas=reps,
            busy_frac=_frac(sum(r.busy_frac * r.alive_s for r in reps), alive),
            wait_input_frac=_frac(sum(r.wait_input_frac * r.alive_s for r in reps), alive),
            blocked_output_frac=_frac(sum(r.blocked_output_frac * r.alive_s for r in reps), alive),
            items_in_per_s=sum(r.items_in_per_s for r in reps),
            items_out_per_s=sum(r.items_out_per_s for r in reps),
            devices=devices.get(name, []),
        ))
    summary = Summary(t_start=t_start, t_end=end.t, elapsed_s=dt, samples=len(window),
                      status=end.status, exit_code=end.exit_code, channels=channels,
                      processes=processes, verdict=Verdict(text=""), host_cpus=log.host.cpus)
    if end.deadlock is not None:  # no stage is slow: nothing can move at all
        return msgspec.structs.replace(summary, verdict=Verdict(text=f"deadlock: {end.deadlock}",
                                                                deadlock=True))
    return msgspec.structs.replace(summary, verdict=find_bottleneck(summary, graph))


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _slow_replica(proc: ProcessSummary) -> tuple[ReplicaSummary, str] | None:
    """The replica of ``proc`` that stands out as slower than its siblings, with the reason."""
    if len(proc.replicas) < 2:
        return None
    for rep in sorted(proc.replicas, key=lambda r: -r.busy_frac):
        others = [r for r in proc.replicas if r is not rep]
        busy_med = statistics.median(r.busy_frac for r in others)
        if rep.busy_frac - busy_med >= REPLICA_BUSY_MARGIN:
            blocked_med = statistics.median(r.blocked_output_frac for r in others)
            why = f"busy {_pct(rep.busy_frac)} vs {_pct(busy_med)} median of {len(others)} siblings"
            if blocked_med >= REPLICA_BUSY_MARGIN:
                why += f", which are blocked {_pct(blocked_med)} on output"
            return rep, why
    for rep in sorted(proc.replicas, key=lambda r: r.items_out_per_s):
        others = [r for r in proc.replicas if r is not rep]
        rate_med = statistics.median(r.items_out_per_s for r in others)
        if rate_med > 0 and rep.items_out_per_s < REPLICA_RATE_RATIO * rate_med:
            return rep, (f"{rate(rep.items_out_per_s)} out vs {rate(rate_med)} median of "
                         f"{len(others)} siblings")
    return None


def head_of_line(summary: Summary, stage: str | None = None) -> tuple[ChannelSummary, float] | None:
    """The ordered channel with the most head-of-line evidence, if it reaches ``HOL_FLOOR``.

    The sampled fraction always counts; the lower bound from the averages (module docstring)
    counts when ``stage`` (the stage rule's bottleneck) is None or one of the channel's writers."""
    best: tuple[ChannelSummary, float] | None = None
    for c in summary.channels:
        if not c.ordered or c.capacity <= 0:
            continue
        evidence = c.head_of_line_frac
        if stage is None or stage in c.writers:
            evidence = max(evidence, c.receive_wait_frac + min(c.fill_avg / c.capacity, 1.0) - 1.0)
        if evidence >= HOL_FLOOR and (best is None or evidence > best[1]):
            best = (c, evidence)
    return best


def _hol_verdict(chan: ChannelSummary, evidence: float, procs: dict[str, ProcessSummary],
                 stage_verdict: Verdict) -> Verdict:
    readers = "+".join(chan.readers) or "the receiver"
    why = (f"head-of-line on ordered channel '{chan.name}': the next item in sequence is late; "
           f"{readers} waits {_pct(chan.receive_wait_frac)} of the time while it holds "
           f"{chan.fill_avg:.0f}/{chan.capacity} items on average (both at once >= {_pct(evidence)})")
    if chan.send_blocked_frac >= REPLICA_BUSY_MARGIN:
        why += f"; {'+'.join(chan.writers) or '?'} blocked {_pct(chan.send_blocked_frac)} sending items ahead of it"
    for writer in chan.writers:
        slow = _slow_replica(procs[writer]) if writer in procs else None
        if slow:
            return Verdict(text=f"bottleneck: {slow[0].qualname} (slow replica of {writer}: {slow[1]}; "
                                f"it holds the sequence of '{chan.name}': {why})",
                           stage=writer, replica=slow[0].qualname, score=evidence, channel=chan.name)
    writers = "+".join(chan.writers) or "its writers"
    spread = (f"no single replica of {writers} is slower: the late item moves between them"
              if any(len(procs[w].replicas) > 1 for w in chan.writers if w in procs) else f"{writers} is late")
    return Verdict(text=f"bottleneck: ordered channel '{chan.name}' holds everyone back ({why}; {spread})",
                   score=evidence, channel=chan.name)


def find_bottleneck(summary: Summary, graph: GraphInfo) -> Verdict:
    """Apply the bottleneck rule of the module docstring to ``summary``; never raises."""
    procs = {p.name: p for p in summary.processes}
    verdict = _stage_verdict(summary, graph)
    hol = head_of_line(summary, verdict.stage) if procs else None
    return _hol_verdict(*hol, procs, verdict) if hol else verdict


def _stage_verdict(summary: Summary, graph: GraphInfo) -> Verdict:
    """The stage rule alone (no head-of-line check)."""
    procs = {p.name: p for p in summary.processes}
    chans = {c.name: c for c in summary.channels}
    if not procs:
        return Verdict(text="bottleneck: unknown (no process statistics yet)")
    infos = {p.name: p for p in graph.processes}
    scored = []
    for name, proc in procs.items():
        info = infos.get(name)
        ins = [chans[c] for c in (info.inputs.values() if info else ()) if c in chans]
        outs = [chans[c] for c in (info.outputs.values() if info else ()) if c in chans]
        busy = max(r.busy_frac for r in proc.replicas)
        up = max(ins, key=lambda c: c.send_blocked_frac, default=None)
        down = max(outs, key=lambda c: c.receive_wait_frac, default=None)
        evidence = [busy] + ([up.send_blocked_frac] if up else []) + ([down.receive_wait_frac] if down else [])
        scored.append((sum(evidence) / len(evidence), busy, name, up, down))
    scored.sort(key=lambda s: (-s[0], s[2]))
    score, busy, name, up, down = scored[0]
    if busy < BUSY_FLOOR:
        busiest = max(scored, key=lambda s: s[1])
        return Verdict(text=f"bottleneck: none clear (busiest stage {busiest[2]} is busy only "
                            f"{_pct(busiest[1])}; time goes to waiting)", score=score)
    parts = []
    stage, replica = name, None
    slow = _slow_replica(procs[name])
    if slow:
        replica = slow[0].qualname
        parts.append(f"slow replica of {name}: {slow[1]}")
    else:
        parts.append(f"busy {_pct(procs[name].busy_frac)}")
    if down:
        parts.append(f"{'+'.join(down.readers) or '?'} waits {_pct(down.receive_wait_frac)} on '{down.name}'")
    if up:
        parts.append(f"{'+'.join(up.writers) or '?'} blocked {_pct(up.send_blocked_frac)} on '{up.name}'")
    if len(scored) > 1 and scored[1][0] >= score - 0.05 and scored[1][1] >= BUSY_FLOOR:
        parts.append(f"{scored[1][2]} close behind")
    return Verdict(text=f"bottleneck: {replica or stage} ({'; '.join(parts)})",
                   stage=stage, replica=replica, score=score)


__all__ = [
    "ChannelInfo", "ChannelSummary", "GraphInfo", "ProcessInfo", "ProcessSummary", "ReplicaSummary",
    "Sample", "StatsFormatError", "StatsReader", "Summary", "Verdict", "find_bottleneck", "head_of_line", "read_stats",
    "stats_path", "summarize",
]
