"""csp across processes and hosts on torch.distributed (torchrun).

``torchrun --nproc-per-node N -m csp.run GRAPH.toml`` runs each rank's share of the graph; channels
whose ends live on different ranks are carried over gloo (CPU tensors, control) and NCCL (CUDA
tensors) with credit-based flow control; a failure on any rank stops every rank. See
docs/distributed.md. Importing this package does not import torch; :func:`run` does. Modules::

    placement.py   which rank runs which replica, which channels cross ranks, their links
    wire.py        lanes between two ranks: a framed control message, then one send per tensor
    crossing.py    one crossing channel on one rank: outbox and inbox halves, pump and feeder
                   threads, the DistSender / DistReceiver ends its processes hold
    bridge.py      Hub: the credits, lanes and failure handling of every crossing channel
    control.py     the run-wide abort key and the peers' heartbeats in the torch.distributed store
    launch.py      run(): a rank's share of the graph under torchrun; hard_exit(), process_group()
"""

from csp.distributed.placement import ChannelPlan, Link, Placement, place

__all__ = ["ChannelPlan", "DistResult", "DistRun", "Link", "Placement", "current", "hard_exit",
           "launched", "place", "process_group", "run"]


def __getattr__(name: str):  # lazy: launch imports torch.distributed
    if name in ("DistResult", "DistRun", "current", "hard_exit", "launched", "process_group", "run", "cli"):
        from csp.distributed import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'csp.distributed' has no attribute {name!r}")
