"""csp across processes and hosts on torch.distributed (torchrun).

``torchrun --nproc-per-node N -m csp.run GRAPH.toml`` runs each rank's share of the graph
(:mod:`csp.distributed.placement`); channels whose ends live on different ranks are carried by
:mod:`csp.distributed.bridge` over gloo (CPU tensors, control) and NCCL (CUDA tensors) with
credit-based flow control; a failure on any rank stops every rank (:mod:`csp.distributed.control`).
See docs/distributed.md.

Importing this package does not import torch; :func:`run` does.
"""

from csp.distributed.placement import ChannelPlan, Link, Placement, place

__all__ = ["ChannelPlan", "DistResult", "DistRun", "Link", "Placement", "current", "hard_exit",
           "launched", "place", "process_group", "run"]


def __getattr__(name: str):  # lazy: launch imports torch.distributed
    if name in ("DistResult", "DistRun", "current", "hard_exit", "launched", "process_group", "run", "cli"):
        from csp.distributed import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'csp.distributed' has no attribute {name!r}")
