"""Watching a run: statistics logs, traces, the backpressure verdict, what-if, and pictures.

Owns the writers a runtime drives (:mod:`~csp.observe.statslog`: ``stats.jsonl``;
:mod:`~csp.observe.trace`: a Chrome/Perfetto trace), and everything that reads what they wrote:
:mod:`~csp.observe.stats_reader` (parse, incl. a live, growing log), :mod:`~csp.observe.backpressure`
(fill, blocked and waiting fractions, the bottleneck rule), :mod:`~csp.observe.whatif` (the rate
with one more replica), :mod:`~csp.observe.draw`, :mod:`~csp.observe.layout` and
:mod:`~csp.observe.svg` (a graph file laid out and drawn, optionally annotated with a run's
measurements), :mod:`~csp.observe.units` (human-readable rates).
Observability never blocks a process: writers sample, readers only read files. It imports the
core's statistics records and the graph; the commands ``python -m csp.inspect`` and
``python -m csp.graph`` sit above it. This ``__init__`` imports nothing.
"""
