"""The csp process kinds of the DFlash training graph.

``dflash.prefetch -> dflash.target (replicas) -> dflash.postprocess -> dflash.drafter -> dflash.monitor``,
and beside it ``dflash.drafter -> dflash.evaluator -> dflash.monitor`` (held-out tau while training).

Each kind reads the frozen options struct built for it by :func:`dflash.run.resolve.resolve` (no
stage reads the graph file) and declares its ports as typed ``TypedDict``s. Importing this package
registers the kinds with csp's registry. The stages are glue: the work they do is in
:mod:`dflash.data` (the sampler), :mod:`dflash.model` (the target forward, the features),
:mod:`dflash.train` (the step), :mod:`dflash.eval` (the held-out decode) and :mod:`dflash.observe`
(the metrics); they are handed the run's :class:`dflash.run.app.RunApp` as ``ctx.app``. Modules::

    prefetch.py     dflash.prefetch: batches from the sampler, anchors sampled, pinned for a GPU
    target.py       dflash.target: a frozen target replica per device; the captured hidden states
    postprocess.py  dflash.postprocess: hidden states -> the drafter's input on the drafter's device
    trainer.py      dflash.drafter: trains the drafter; checkpoints, weight snapshots, the time budget
    monitor.py      dflash.monitor: step-indexed metrics to metrics.jsonl, wandb and the display
    evaluator.py    dflash.evaluator: held-out tau of the drafter's snapshots while it trains
    heldout.py      the evaluator's decode, in the training process or in a child process
"""

from dflash.run.stages.evaluator import EvaluatorStage
from dflash.run.stages.monitor import MonitorStage
from dflash.run.stages.postprocess import PostprocessStage
from dflash.run.stages.prefetch import PrefetchStage
from dflash.run.stages.target import TargetStage
from dflash.run.stages.trainer import DrafterStage

__all__ = ["PrefetchStage", "TargetStage", "PostprocessStage", "DrafterStage", "MonitorStage", "EvaluatorStage"]
