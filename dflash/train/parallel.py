"""Data-parallel drafter replicas on torch.distributed (DDP), and their checkpoints.

Layout: under ``torchrun ... -m dflash.run`` the drafter process gets ``replicas = N`` with one
replica per rank (``ranks = [...]`` in the graph file, or the default placement ``replica i ->
rank i``). :mod:`csp.distributed` creates, on every rank and before any process starts, a process group
over the ranks of each process whose replicas span several ranks; :func:`wrap` puts the drafter
in ``DistributedDataParallel`` over that group, so gradients are averaged across the drafter
replicas (all-reduce in backward) and every replica applies the same AdamW update.

Checkpoints with several drafter ranks (replica = the drafter's rank inside its group):

* replica 0 writes the weights and ``meta.json`` as in a single-process run (:func:`is_writer`);
  with DDP the other replicas hold identical weights and, since they apply identical updates
  from identical initial states, identical optimizer moments too: they are *replicas*;
* every replica still writes its own small ``train_state`` (optimizer, scheduler, RNG state and
  anything per-rank such as the last sampler state it saw) to
  ``CKPT_ROOT/rank_state/step_<step>.rank<replica>.pt`` (:func:`save_rank_state`, atomic; the
  layout is :mod:`dflash.checkpoint.format`'s), and on
  resume reloads its own file (:func:`load_rank_state`): a run resumed on the same number of
  drafter ranks continues bit-for-bit, RNG streams included;
* :func:`barrier` after the per-rank save keeps replica 0 from declaring a checkpoint complete
  before every replica's state is on disk.

Outside a distributed run (plain ``python -m dflash.run``) every helper is a no-op: :func:`wrap`
returns the module unchanged, :func:`is_writer` is True, :func:`barrier` returns at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import csp
from dflash.checkpoint import rank_state_path, read_rank_state, write_rank_state  # noqa: F401 - rank_state_path re-exported

__all__ = ["barrier", "group", "is_writer", "load_rank_state", "rank_state_path", "save_rank_state",
           "unwrap", "world", "wrap"]


def group(ctx: csp.Context) -> Any | None:
    """The process group over the ranks running replicas of ``ctx.name``, or None when the run is
    not distributed or all replicas share one rank."""
    from csp.distributed import current

    run = current()
    if run is None:
        return None
    g = run.groups.get(ctx.name)
    if g is None:
        return None
    ranks = run.placement.ranks_of(ctx.name)
    if len(set(ranks)) != len(ranks):
        raise RuntimeError(
            f"process {ctx.name!r}: data-parallel replicas need one replica per rank, but they are "
            f"placed on ranks {ranks}; set ranks = [0, 1, ...] with distinct ranks"
        )
    return g


def world(ctx: csp.Context) -> int:
    """Number of data-parallel replicas of ``ctx.name`` (1 outside a distributed run)."""
    return ctx.replicas if group(ctx) is not None else 1


def wrap(module: nn.Module, ctx: csp.Context, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel(module)`` over :func:`group`, or ``module`` itself without one.

    Call it in ``setup()`` on every replica (DDP's constructor broadcasts replica 0's parameters
    and buffers to the others, a collective). ``module`` must already be on ``ctx.device``.
    ``ddp_kwargs`` go to DDP (e.g. ``find_unused_parameters=True``).

    Raises:
        RuntimeError: the replicas are placed two on one rank.
    """
    g = group(ctx)
    if g is None:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = ctx.device
    ids = [dev] if dev is not None and dev.type == "cuda" else None
    return DDP(module, device_ids=ids, process_group=g, **ddp_kwargs)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (what to save and export), else ``module``."""
    return getattr(module, "module", module) if type(module).__name__ == "DistributedDataParallel" else module


def is_writer(ctx: csp.Context) -> bool:
    """True on the replica that writes shared files (weights, meta.json, metrics): replica 0."""
    return group(ctx) is None or ctx.replica == 0


def barrier(ctx: csp.Context) -> None:
    """Wait until every data-parallel replica of ``ctx.name`` got here (no-op without a group)."""
    g = group(ctx)
    if g is not None:
        torch.distributed.barrier(group=g)


def save_rank_state(ckpt_root: str | Path, step: int, ctx: csp.Context, state: dict[str, Any]) -> Path:
    """Write this replica's ``state`` (``torch.save``-able: optimizer/scheduler state dicts, RNG
    state, sampler state) atomically (:func:`dflash.checkpoint.files.write_rank_state`), then :func:`barrier`.

    Returns: the file written. Raises: OSError from the filesystem.
    """
    path = write_rank_state(ckpt_root, step, ctx.replica, state)
    barrier(ctx)
    return path


def load_rank_state(ckpt_root: str | Path, step: int, ctx: csp.Context) -> dict[str, Any] | None:
    """This replica's state saved at ``step``, or None if there is none (a checkpoint written
    by a run with fewer drafter ranks: the caller falls back to replica 0's ``train_state``)."""
    return read_rank_state(ckpt_root, step, ctx.replica)
