"""Run a graph's share on this rank: ``torchrun --nproc-per-node N -m csp.run GRAPH.toml``.

:func:`run` does, on every rank, in this order (the collective steps in the same order on all):

1. join the job: ``torch.distributed`` from the torchrun environment (``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``), default group ``gloo`` (``cpu:gloo,cuda:nccl`` when CUDA
   is there); an already initialised default group is used as it is;
2. place the graph (:func:`csp.distributed.placement.place`); every rank computes the same placement;
3. create the process groups: a world gloo group (final barrier), per lane a 2-rank gloo group
   (and an NCCL one when the graph uses CUDA), and per process whose replicas span several
   ranks a group over those ranks (:func:`process_group`; DDP for data-parallel replicas);
4. run a :class:`csp.Runtime` over this rank's instances only, its crossing channels built by
   :class:`csp.distributed.bridge.Hub`; a watcher thread follows the abort key and the other ranks'
   heartbeats (:mod:`csp.distributed.control`): a rank silent for ``peer_timeout_s`` is reported lost;
5. on success wait for the lanes to close (every rank done with every link), barrier, destroy
   the groups. On failure return at once with the first failure's rank and message: call
   :func:`hard_exit` then, as lane threads may still be blocked in gloo/NCCL receives.

Statistics and traces of rank 0 go to ``RUN_DIR/csp/``, of rank r > 0 to
``RUN_DIR/rank<r>/csp/`` (processes on rank r get ``ctx.run_dir = RUN_DIR/rank<r>``).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from time import perf_counter
from typing import Any, Callable

import msgspec

from csp.distributed.bridge import Hub
from csp.distributed.control import PEER_TIMEOUT_S, Control
from csp.distributed.placement import Placement, place
from csp.distributed.wire import LaneReader, LaneWriter
from csp.errors import DistError, ProcessFailed, ProcessStuck
from csp.graph import Graph
from csp.runtime.engine import EXIT_FAILED, Runtime

__all__ = ["DistResult", "DistRun", "current", "hard_exit", "launched", "process_group", "run"]

log = logging.getLogger("csp.distributed")
_current: "DistRun | None" = None


class DistResult(msgspec.Struct, frozen=True, kw_only=True):
    """How the run ended on this rank.

    Attributes:
        status: "completed" | "stopped" | "aborted" | "failed" (also "failed" when another rank
            failed: ``failed_rank`` says which).
        exit_code: 0, 130 or 1 (as :class:`csp.RunResult`).
        duration_s: wall seconds.
        rank: this rank.
        error: the first failure's message, naming its rank (``"rank 1: process ..."``), or None.
        failed_rank: the rank that failed first (-1: unknown, e.g. the store host died), or None.
    """

    status: str
    exit_code: int
    duration_s: float
    rank: int
    error: str | None = None
    failed_rank: int | None = None


@dataclass
class DistRun:
    """What a process instance can ask about the distributed run (:func:`current`).

    Attributes:
        rank, world_size, local_rank: from the torchrun environment.
        placement: the graph's placement (identical on every rank).
        groups: ``process name -> ProcessGroup`` over the ranks of that process's replicas (only
            for processes whose replicas span several ranks).
    """

    rank: int
    world_size: int
    local_rank: int
    placement: Placement
    groups: dict[str, Any]


def launched() -> bool:
    """True when the torchrun environment is present (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def current() -> DistRun | None:
    """The distributed run of this OS process, or None outside :func:`run`."""
    return _current


def process_group(name: str) -> Any:
    """The process group over the ranks running replicas of process ``name``.

    Raises:
        DistError (a RuntimeError): not inside a distributed run, or ``name``'s replicas are all on one rank
            (say so in the graph: give it ``ranks = [...]`` on several ranks).
    """
    run_ = _current
    if run_ is None:
        raise DistError("csp.distributed.process_group() needs a distributed run (torchrun ... -m csp.run)")
    if name not in run_.groups:
        raise DistError(f"process {name!r} has all its replicas on one rank: it has no process "
                           "group (place its replicas on several ranks with ranks = [...])")
    return run_.groups[name]


def _init(timeout: timedelta) -> tuple[Any, int, int, bool]:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, rank, world = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world, timeout=timeout)
    return store, rank, world, True


def _home_device(graph: Graph, placement: Placement, rank: int, local_rank: int) -> Any:
    import torch

    if not torch.cuda.is_available():
        return None
    for (name, i), r in sorted(placement.ranks.items()):
        dev = graph.processes[name].devices[i]
        if r == rank and dev and dev.startswith("cuda"):
            return torch.device(dev)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def run(graph: Graph, *, run_dir: Path | str | None = None, app: Any = None, trace: Any = None,
        join_timeout_s: float = 10.0, timeout_s: float = 1800.0,
        peer_timeout_s: float = PEER_TIMEOUT_S,
        exit_code_of: Callable[[str, BaseException | None], int | None] | None = None) -> tuple[DistResult, Runtime]:
    """Run this rank's share of ``graph`` (call on every rank). See the module doc.

    Args:
        graph: the validated graph (the same on every rank).
        run_dir: the run directory (rank r > 0 writes under ``run_dir/rank<r>``); None writes nothing.
        app, trace, join_timeout_s, exit_code_of: as :class:`csp.Runtime`.
        timeout_s: torch.distributed timeout of the groups (rendezvous, barrier, a tensor transfer
            that started); waiting for the next item is not bounded by it.
        peer_timeout_s: seconds without another rank's heartbeat before the run fails naming
            that rank (:data:`csp.distributed.control.PEER_TIMEOUT_S`, 60 s; 0 = off).

    Returns:
        ``(DistResult, Runtime)``; on status "failed" call :func:`hard_exit` when done reporting.

    Raises:
        GraphError: the placement is invalid (every rank raises the same error).
        csp.errors.DistConfigError (a ValueError): ``peer_timeout_s`` is negative.
    """
    global _current
    import torch.distributed as dist

    t0 = perf_counter()
    timeout = timedelta(seconds=timeout_s)
    store, rank, world, _ = _init(timeout)
    placement = place(graph, world)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    uses_cuda = any(d and d.startswith("cuda") for p in graph.processes.values() for d in p.devices)
    nccl = uses_cuda and dist.is_nccl_available()
    device = _home_device(graph, placement, rank, local_rank) if nccl else None
    world_gloo = dist.new_group(backend="gloo", timeout=timeout)
    writers: dict[int, LaneWriter] = {}
    readers: dict[int, LaneReader] = {}
    for a, b in placement.lanes():  # every rank creates every group, in the same order
        g = dist.new_group([a, b], backend="gloo", timeout=timeout)
        n = dist.new_group([a, b], backend="nccl", timeout=timeout) if nccl else None
        if rank == a:
            writers[b] = LaneWriter(b, g, n)
        elif rank == b:
            readers[a] = LaneReader(a, g, n, device)
    groups = {}
    for name in graph.processes:
        ranks = sorted(set(placement.ranks_of(name)))
        if len(ranks) > 1:
            groups[name] = dist.new_group(ranks, timeout=timeout)
    _current = DistRun(rank, world, local_rank, placement, groups)

    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if "MASTER_PORT" in os.environ else None
    control = Control(store, rank, world, peer_timeout_s, store_address=addr)
    rt_box: list[Runtime] = []

    def stop_all(reason: str) -> None:
        hub.remote_reason = reason
        if rt_box:
            rt_box[0].abort()
        hub.abort(reason)

    def on_failure(message: str) -> None:  # a bridge/lane of this rank failed
        r, msg = control.report(f"rank {rank}: {message}")
        stop_all(msg)

    def on_abort(reason: str) -> None:  # the local runtime aborted a crossing channel
        control.report(f"rank {rank}: {reason}")

    def on_remote(r: int, msg: str) -> None:
        log.error("rank %d: stopping because %s", rank, msg)
        stop_all(msg)

    hub = Hub(placement, rank, {p: (writers[p], readers[p]) for p in placement.peers(rank)},
              on_failure, on_abort)
    rd = None if run_dir is None else (Path(run_dir) if rank == 0 else Path(run_dir) / f"rank{rank}")
    rt = Runtime(graph, run_dir=rd, app=app, trace=trace, join_timeout_s=join_timeout_s,
                 instances=placement.instances(rank), channel_factory=hub.factory, exit_code_of=exit_code_of)
    rt_box.append(rt)
    hub.start_lanes()
    control.watch(on_remote)
    status, code = "failed", EXIT_FAILED
    try:
        result = rt.run()
        status, code = result.status, result.exit_code
    except (ProcessFailed, ProcessStuck) as exc:  # a stuck thread is reported like a failure
        control.report(f"rank {rank}: {exc}")
        hub.abort(str(exc))
    if control.seen is None and status != "failed":
        stuck = hub.join()  # until every lane closed (other ranks may still be working)
        if control.seen is None and not stuck:
            dist.barrier(group=world_gloo)
            control.stop()
            dist.destroy_process_group()
            _current = None
            return DistResult(status=status, exit_code=code, duration_s=perf_counter() - t0, rank=rank), rt
    if control.seen is None:  # a bridge stopped without a reported failure: report it now
        control.report(f"rank {rank}: the run ended with status {status!r} before its channels drained")
    failed_rank, error = control.seen  # type: ignore[misc]
    control.linger()
    control.stop()
    return DistResult(status="failed", exit_code=EXIT_FAILED, duration_s=perf_counter() - t0, rank=rank,
                      error=error, failed_rank=failed_rank), rt


def hard_exit(code: int) -> None:
    """Flush stdio and leave the OS process at once (``os._exit``): after a failure, lane threads
    may be blocked in gloo/NCCL receives that no timeout ends, and tearing the groups down could
    wait for them."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


def cli(graph: Graph, run_dir: Path | None, stream: Any = None) -> int:
    """``python -m csp.run`` under torchrun: run, print this rank's outcome, exit (see module doc)."""
    out = stream if stream is not None else sys.stdout
    result, rt = run(graph, run_dir=run_dir)
    r = result.rank
    if result.error is not None:
        print(f"rank {r}: error: {result.error}", file=sys.stderr)
        hard_exit(result.exit_code)
    print(f"rank {r}: {result.status} in {result.duration_s:.2f} s (exit code {result.exit_code})", file=out)
    for q, st in rt.statistics()["processes"].items():
        print(f"rank {r}:   {q:<20} busy {st.busy_s:7.3f} s  wait_input {st.wait_input_s:7.3f} s  "
              f"blocked_output {st.blocked_output_s:7.3f} s  in {st.items_in:>7}  out {st.items_out:>7}",
              file=out)
    return result.exit_code

