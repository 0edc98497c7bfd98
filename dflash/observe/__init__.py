"""What an operator reads: the live display, the run log, the metrics file, and the tools that
read a run directory afterwards.

Imports: :mod:`dflash.checkpoint` (checkpoint health), the leaf modules and csp; never the
models, the trainer or the run, so the reports read any run directory without building a model
(the record types are :mod:`dflash.records`). Modules::

    config.py           the [monitor] table: windows, wandb, the display, spikes, the plot
    display.py          the live training display: throughput, loss, accepted length, ETA, channel fills
    runlog.py           where dflash.run output goes: the terminal and RUN_DIR/run.log
    metrics_writer.py   metrics.jsonl, fixed step windows and the wandb sink
    spikes.py           the loss-spike rule the monitor and python -m dflash.logs share
    logs.py             python -m dflash.logs RUN_DIR: what happened in a run, from its files alone
    plot.py             python -m dflash.plot RUN_DIR: a run's training curves as one PNG
    summary.py          the closing summary dflash.run prints when a run ends, however it ends
"""
