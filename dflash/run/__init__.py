"""``python -m dflash.run GRAPH.toml``: the training graph, from the file to the running stages.

One pass, one module a step (:mod:`~dflash.run.cli` reads top to bottom): load the graph file
(:mod:`~dflash.run.config`: ``[run]`` and the file that assembles every room's table), resolve it
against the target and its tokenizer (:mod:`~dflash.run.resolve`, building each stage's frozen
options, :mod:`~dflash.run.options`), validate every rule once (:mod:`~dflash.run.validate`, which
calls each room's own checks), build the csp graph, take the run directory
(:mod:`~dflash.run.run_dir`), prepare the data and the resume state (:mod:`~dflash.run.prepare`)
and run. What the stages share at run time is :mod:`~dflash.run.app`; the csp process kinds are
:mod:`dflash.run.stages` (``dflash.prefetch -> dflash.target -> dflash.postprocess ->
dflash.drafter -> dflash.monitor``); :mod:`~dflash.run.step_gate` serialises a step on new
shapes. The top floor of the training path: it may import every other room, and none imports it
(the tools :mod:`dflash.regenerate` and the benchmarks do). This ``__init__`` imports nothing,
so ``--help`` answers before torch loads.
"""
