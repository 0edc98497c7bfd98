"""``python -m dflash.run GRAPH.toml``: the training graph, from the file to the running stages.

Owns the command line (:mod:`~dflash.run.cli`: what a run does, in order; its parser in
:mod:`~dflash.run.args`), the graph file's dflash tables (:mod:`~dflash.run.config`), the pure
resolve step (:mod:`~dflash.run.resolve`: every cross-table check of
:mod:`~dflash.run.preflight`, then each stage's frozen options), what the stages share for one run
(:mod:`~dflash.run.app`) and the csp process kinds themselves (:mod:`dflash.run.stages`:
``dflash.prefetch -> dflash.target -> dflash.postprocess -> dflash.drafter -> dflash.monitor``).
The top floor of the training path: it may import every other room, and none imports it (the
tools :mod:`dflash.regenerate` and the benchmarks do). This ``__init__`` imports nothing, so
``--help`` answers before torch loads.
"""
