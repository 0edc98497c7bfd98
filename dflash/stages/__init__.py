"""The csp process kinds of the DFlash training graph.

``dflash.prefetch -> dflash.target (replicas) -> dflash.postprocess -> dflash.drafter -> dflash.monitor``

One module per kind (``dflash.drafter`` lives in ``trainer.py``), each with the frozen options
struct it reads (built by :func:`dflash.resolve.resolve`; no stage reads the graph file). Importing
this package registers the kinds with csp's registry.
"""

from dflash.stages.trainer import DrafterStage
from dflash.stages.monitor import MonitorStage
from dflash.stages.postprocess import PostprocessStage
from dflash.stages.prefetch import PrefetchStage
from dflash.stages.target import TargetStage

__all__ = ["PrefetchStage", "TargetStage", "PostprocessStage", "DrafterStage", "MonitorStage"]
