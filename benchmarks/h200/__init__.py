"""H200 stage and pipeline measurements: ``suite.py`` (the recipe: a suite in one device call), ``bench.py``
(serial, colocated and pipeline rates: the command line; ``bench_plan.py`` its plan and measurements),
``perf.py`` (peaks, the target and the drafter alone, profiles: the command line; ``perf_rows.py`` its
rows, ``profiling.py`` the profiler window), ``graphs.py`` (the example graphs and the tiny/CPU
settings the scripts share), ``lengths.py`` (tokens/s and peak memory by sequence length, with and
without activation checkpointing and a sliding window), ``stages.py`` (the stages as the graph runs
them), ``flops.py`` (MFU accounting), ``combine.py`` / ``report.py`` / ``plot.py`` (the results file,
its table and picture).
"""
