"""H200 stage and pipeline measurements: ``suite.py`` (the recipe: a suite in one device call), ``bench.py``
(serial, colocated and pipeline rates), ``perf.py`` (peaks, the target and the drafter alone,
profiles), ``stages.py`` (the stages as the graph runs them), ``flops.py`` (MFU accounting),
``combine.py`` / ``report.py`` / ``plot.py`` (the results file, its table and picture).
"""
