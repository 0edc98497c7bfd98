"""csp across processes and hosts on torch.distributed (torchrun).

``torchrun --nproc-per-node N -m csp.run GRAPH.toml`` runs each rank's share of the graph
(:mod:`csp.dist.placement`); channels whose ends live on different ranks are carried by
:mod:`csp.dist.bridge` over gloo (CPU tensors, control) and NCCL (CUDA tensors) with
credit-based flow control; a failure on any rank stops every rank (:mod:`csp.dist.control`).
See docs/distributed.md.

Importing this package does not import torch; :func:`run` does.
"""

from csp.dist.placement import ChannelPlan, Link, Placement, place

__all__ = ["ChannelPlan", "DistResult", "DistRun", "Link", "Placement", "current", "hard_exit",
           "launched", "place", "process_group", "run"]


def __getattr__(name: str):  # lazy: launch imports torch.distributed
    if name in ("DistResult", "DistRun", "current", "hard_exit", "launched", "process_group", "run", "cli"):
        from csp.dist import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'csp.dist' has no attribute {name!r}")
