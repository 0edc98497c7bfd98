"""What an operator reads: the live display, the run log, the metrics file, and the tools that
read a run directory afterwards.

Owns the terminal display (:mod:`~dflash.observe.display`), the log set-up and ``run.log``
(:mod:`~dflash.observe.runlog`), the ``metrics.jsonl`` writer
(:mod:`~dflash.observe.metrics_writer`; the record types are :mod:`dflash.records`), the spike rule
(:mod:`~dflash.observe.spikes`), ``python -m dflash.logs`` (:mod:`~dflash.observe.logs`),
``python -m dflash.plot`` (:mod:`~dflash.observe.plot`) and the closing summary of a run
(:mod:`~dflash.observe.summary`). Imports: :mod:`dflash.checkpoint` (checkpoint health), the leaf
modules and csp; never the models, the trainer or the run, so the reports read any run directory
without building a model.
"""
