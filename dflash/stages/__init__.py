"""The csp process kinds of the DFlash training graph.

``dflash.prefetch -> dflash.target (replicas) -> dflash.postprocess -> dflash.drafter -> dflash.monitor``

Importing this package registers the kinds with csp's registry.
"""

from dflash.stages.trainer import DrafterStage
from dflash.stages.monitor import MonitorStage
from dflash.stages.postprocess import PostprocessStage
from dflash.stages.prefetch import PrefetchStage
from dflash.stages.target import TargetStage

__all__ = ["PrefetchStage", "TargetStage", "PostprocessStage", "DrafterStage", "MonitorStage"]
