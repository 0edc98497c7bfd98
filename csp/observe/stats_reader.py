"""Reading a csp run's stats log, ``RUN_DIR/csp/stats.jsonl`` (written by :mod:`csp.observe.statslog`).

The log (format in ``docs/architecture.md``) holds a header with the graph, then periodic snapshots
of cumulative counters (:class:`csp.core.stats.ChannelStatistics`, :class:`csp.core.stats.ProcessStatistics`),
then a final record. :class:`StatsReader` parses it incrementally, so ``csp.inspect --follow`` can
tail a live run; :mod:`csp.observe.backpressure` turns the records into summaries and a bottleneck verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from csp.core.stats import ChannelStatistics, ProcessStatistics
from csp.errors import StatsFormatError, StatsNotFound


class ChannelInfo(msgspec.Struct, frozen=True):
    name: str
    capacity: int
    ordered: bool = False


class ProcessInfo(msgspec.Struct, frozen=True):
    name: str
    replicas: int = 1
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    devices: list[str | None] = []
    """One per replica ("cpu", "cuda:N", or None: not bound); empty in logs written before it was."""


class GraphInfo(msgspec.Struct, frozen=True):
    channels: list[ChannelInfo] = []
    processes: list[ProcessInfo] = []

    def writers(self, channel: str) -> list[ProcessInfo]:
        """Processes with an output port on ``channel``."""
        return [p for p in self.processes if channel in p.outputs.values()]

    def readers(self, channel: str) -> list[ProcessInfo]:
        """Processes with an input port on ``channel``."""
        return [p for p in self.processes if channel in p.inputs.values()]


class HostInfo(msgspec.Struct, frozen=True):
    cpus: int = 0
    """The machine's CPU count (``os.cpu_count()``; 0: not recorded)."""


class _Header(msgspec.Struct):
    t0: float
    graph: GraphInfo
    host: HostInfo = HostInfo()


class Sample(msgspec.Struct, frozen=True):
    """One snapshot (or the final record): cumulative counters at ``t`` seconds after the start."""

    t: float
    channels: dict[str, ChannelStatistics]
    processes: dict[str, ProcessStatistics]
    status: str | None = None
    exit_code: int | None = None
    deadlock: str | None = None
    """The final record of a deadlocked run: its cycle of waits (``csp.runtime.deadlock``)."""


class StatsReader:
    """The records of one stats.jsonl, built incrementally (``feed``) so ``--follow`` can tail it.

    Attributes:
        t0: unix time of the run start (0.0 until the header is read).
        graph: the graph from the header.
        host: the machine it ran on, from the header (its CPU count).
        samples: snapshots in file order, the final record last.
        final: the final record, or None while the run is live (or if it crashed).
        truncated_tail: True when the file ended in half a line (the writer died mid-write).
        header_seen: the header record has been read (a stats log's first record; any other
            first record is a StatsFormatError saying the file is not a stats log).
    """

    def __init__(self, source: str = "stats.jsonl") -> None:
        self.source = source
        self.t0 = 0.0
        self.graph = GraphInfo()
        self.host = HostInfo()
        self.samples: list[Sample] = []
        self.final: Sample | None = None
        self.truncated_tail = False
        self.header_seen = False
        self._pending = ""
        self._line = 0

    def feed(self, text: str) -> int:
        """Parse the complete lines of ``text`` (a trailing partial line is kept for the next call).

        Returns: the number of records added. Raises: StatsFormatError on a malformed line.
        """
        text = self._pending + text
        lines = text.split("\n")
        self._pending = lines.pop()  # "" when text ended with a newline
        added = 0
        for line in lines:
            self._line += 1
            if line.strip():
                added += self._add(line)
        return added

    def feed_tail(self) -> int:
        """Parse the trailing line that has no newline yet once it is a whole record: a log whose
        writer ended without the last newline (an editor's save, a copied file) is then complete.
        A half-written record (a live writer mid-line) is left for the next :meth:`feed`.

        Returns: the number of records added (0 or 1). Raises: StatsFormatError when the line is
        not JSON-lines at all and no header was seen (the file is not a stats log).
        """
        tail = self._pending.strip()
        if not tail:
            return 0
        try:
            msgspec.json.decode(tail)
        except msgspec.DecodeError:
            if self.header_seen or tail.startswith("{"):
                return 0  # the rest of the record is still to come
        return self.feed("\n")

    def _add(self, line: str) -> int:
        where = f"{self.source}:{self._line}"
        try:
            raw: Any = msgspec.json.decode(line)
        except msgspec.DecodeError as e:
            if not self.header_seen:
                raise StatsFormatError(self._not_a_stats_log()) from None
            raise StatsFormatError(f"{where}: {e} (see docs/architecture.md, stats.jsonl)") from e
        kind = raw.get("kind") if isinstance(raw, dict) else None
        if not self.header_seen and kind != "header":
            raise StatsFormatError(self._not_a_stats_log())
        try:
            if kind == "header":
                header = msgspec.convert(raw, _Header)
                self.t0, self.graph, self.host = header.t0, header.graph, header.host
                self.header_seen = True
                return 1
            if kind in ("snapshot", "final"):
                sample = msgspec.convert(raw, Sample)
                self.samples.append(sample)
                if kind == "final":
                    self.final = sample
                return 1
        except msgspec.ValidationError as e:
            raise StatsFormatError(f"{where}: {e} (see docs/architecture.md, stats.jsonl)") from e
        return 0  # unknown kinds are skipped: newer writers may add records

    def _not_a_stats_log(self) -> str:
        """What is said of a file whose first record is not a stats header (a graph file, a trace,
        another log): a stats log always starts with one."""
        return (f"{self.source} is not a csp stats log (line {self._line} is not its header record); give a "
                "run directory (its csp/stats.jsonl is read) or a csp/stats.jsonl file")


def read_stats(path: str | Path) -> StatsReader:
    """Read a whole stats log; ``path`` is the file or a run directory (``RUN_DIR/csp/stats.jsonl``).

    Raises: StatsNotFound (a FileNotFoundError) naming the expected path; StatsFormatError on a malformed line.
    """
    path = stats_path(path)
    log = StatsReader(str(path))
    log.feed(path.read_text(encoding="utf-8", errors="replace"))  # a binary file: not a stats log
    if log._pending.strip():  # no newline at the end: a complete record, or a crashed writer's half
        try:
            log.feed("\n")
        except StatsFormatError:
            if not log.header_seen:  # not half a record: a one-line file of something else
                raise
            log.truncated_tail = True
    return log


def stats_path(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``path/csp/stats.jsonl`` (StatsNotFound, a FileNotFoundError, if absent)."""
    path = Path(path)
    if path.is_file():
        return path
    candidate = path / "csp" / "stats.jsonl"
    if not candidate.exists():
        raise StatsNotFound(f"no stats log at {candidate}: is {path} a csp run directory?")
    return candidate


__all__ = ["ChannelInfo", "GraphInfo", "HostInfo", "ProcessInfo", "Sample", "StatsReader", "read_stats", "stats_path"]
