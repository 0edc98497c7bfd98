"""Watching a run: statistics logs, traces, the backpressure verdict and what-if.

Owns the writers a runtime drives and everything that reads what they wrote. Observability never
blocks a process: writers sample, readers only read files. It imports only the core's statistics
records and :mod:`csp.errors`, never the graph (a run's file describes its graph), so the graph
room can draw a graph annotated with these measurements; the runtime, ``python -m csp.inspect``
and ``python -m csp.graph`` sit above it. This ``__init__`` imports nothing. Modules:

    statslog.py      StatsWriter: periodic statistics snapshots -> ``RUN_DIR/csp/stats.jsonl``
    trace.py         Tracer: a Chrome/Perfetto trace (process spans, channel fill counters)
    stats_reader.py  StatsReader, read_stats(): ``stats.jsonl`` back into records, a live log too
    backpressure.py  fill, blocked and waiting fractions per channel and process; the bottleneck rule
    whatif.py        per-stage service rates; the rate with one more replica
    units.py         human-readable rates and counts (37K items/s, 1.2 GB/s)
"""
