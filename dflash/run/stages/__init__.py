"""The csp process kinds of the DFlash training graph.

``dflash.prefetch -> dflash.target (replicas) -> dflash.postprocess -> dflash.drafter -> dflash.monitor``,
and beside it ``dflash.drafter -> dflash.evaluator -> dflash.monitor`` (held-out tau while training).

One module per kind (``dflash.drafter`` lives in ``trainer.py``), each with the frozen options
struct it reads (built by :func:`dflash.run.resolve.resolve`; no stage reads the graph file). Importing
this package registers the kinds with csp's registry. The stages are glue: the work they do is
in :mod:`dflash.data` (the sampler), :mod:`dflash.model` (the target forward, the features),
:mod:`dflash.train` (the step), :mod:`dflash.eval` (the held-out decode) and :mod:`dflash.observe`
(the metrics); they are handed the run's
:class:`dflash.run.app.RunApp` as ``ctx.app``.
"""

from dflash.run.stages.evaluator import EvaluatorStage
from dflash.run.stages.monitor import MonitorStage
from dflash.run.stages.postprocess import PostprocessStage
from dflash.run.stages.prefetch import PrefetchStage
from dflash.run.stages.target import TargetStage
from dflash.run.stages.trainer import DrafterStage

__all__ = ["PrefetchStage", "TargetStage", "PostprocessStage", "DrafterStage", "MonitorStage", "EvaluatorStage"]
