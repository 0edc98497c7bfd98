"""H200 stage and pipeline measurements: ``suite.py`` (the recipe: a suite in one device call), ``bench.py``
(serial, colocated and pipeline rates), ``perf.py`` (peaks, the target and the drafter alone,
profiles), ``lengths.py`` (tokens/s and peak memory by sequence length, with and without activation
checkpointing and a sliding window), ``stages.py`` (the stages as the graph runs them), ``flops.py`` (MFU accounting),
``combine.py`` / ``report.py`` / ``plot.py`` (the results file, its table and picture).
"""
