"""The target's tree verify step at a fixed shape, replayed as a CUDA graph on a GPU.

:mod:`dflash.eval.tree_decode` verifies a draft tree of ``B`` nodes in one target forward over
``[anchor, node_1 .. node_B]``. Through transformers' dynamic cache that forward is ~1,000 eager
ops on a 30-layer target, each launched from Python (about 50 us apiece on an H100), and the cache
is re-indexed after every step. :class:`StaticTreeTarget` runs the same step over the static KV
cache of :class:`dflash.eval.static_target.StaticTarget` at the fixed width ``W = B + 1``, so on a
GPU it is one CUDA-graph replay:

* the tree's rows are written at cache slots ``start .. start + W - 1`` (``start``: the anchor's
  position), in node order; each row is rotated at its own position ``start + depth``;
* row ``j`` sees every slot before ``start`` (the context) and, inside the tree's slots, its
  ancestors and itself (``anc[j]``, from the tree's parents); the tree's shape lives in static
  buffers (``anc``, ``depth``, ``start``) that each step overwrites before the replay. A tree
  smaller than ``B`` (the last steps of a generation) pads with rows that see only the context and
  themselves: no real row sees them.
* after the walk, :meth:`StaticTreeTarget.keep_path` moves the accepted path's keys and values
  (rows ``0, r_1 .. r_m``, increasing, as parents precede children) to slots ``start .. start + m``,
  so slot ``i`` holds position ``i`` again, as the chain step and the next tree step expect; the
  slots after them hold stale rows that no later query sees before they are overwritten.

The outputs equal the dynamic-cache tree verify's up to kernel numerics, and greedy tree decoding
through either equals plain greedy decoding (tested).
"""

from __future__ import annotations

import weakref

import torch

from dflash.eval.static_target import StaticTarget, rounded_capacity
from dflash.model.cuda_graph import GraphedStep, weights_signature
from dflash.model.modeling_dflash import tree_visibility
from dflash.model.target import Target

__all__ = ["StaticTreeTarget", "acquire", "ancestors", "pooled", "release"]


def ancestors(parent: list[int], width: int) -> torch.Tensor:
    """Bool ``[width, width]``: the exported file's :func:`~dflash.model.modeling_dflash.tree_visibility`
    of the tree ``[anchor, node_1 .. node_B]`` (row ``j`` sees the anchor, its ancestors and itself),
    padded with rows ``B + 1 ..`` that see only themselves."""
    anc = torch.eye(width, dtype=torch.bool)
    block = tree_visibility(parent)
    anc[: block.shape[0], : block.shape[0]] = block
    return anc


class StaticTreeTarget(StaticTarget):
    """A :class:`StaticTarget` of width ``budget + 1`` with the tree verify step (module docstring).

    Args:
        target: a Llama or Qwen3 :class:`Target`.
        budget: ``B``, draft nodes per tree at most.
        capacity: cache positions, at least the generation's last position + ``B + 1``.
        graphs: capture the tree step as a CUDA graph (CUDA only).

    Raises:
        UnsupportedTarget: as :func:`dflash.eval.static_target.check_supported`.
    """

    def __init__(self, target: Target, budget: int, capacity: int, graphs: bool = True) -> None:
        super().__init__(target, budget + 1, capacity, graphs)
        dev, w = self.slots.device, budget + 1
        self.anc = torch.zeros(w, w, dtype=torch.bool, device=dev)
        self.depth = torch.zeros(w, dtype=torch.long, device=dev)
        self.start = torch.zeros((), dtype=torch.long, device=dev)
        self.tree_step = GraphedStep(self._tree_forward, graphs, dev.type == "cuda",
                                     f"the target's {w}-row tree step")

    def _tree_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.width
        rel = self.slots - self.start                                       # [capacity]
        inside = (rel >= 0) & (rel < w)
        seen = (rel < 0)[None] | (inside[None] & self.anc.index_select(1, rel.clamp(0, w - 1)))
        return self.forward(self.ids, (self.start + self.depth)[None], write=(self.start + self.offsets)[None],
                            seen=seen)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt ``ids [n]`` at positions ``0..n-1``, eagerly: ``(features [1, n, k*H], logits [1, V])``
        (the last position's)."""
        return self.forward(ids[None], torch.arange(ids.shape[0], device=ids.device)[None], last_only=True)

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, depth: list[int], parent: list[int], start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree ``ids [1 + b]`` (anchor, then ``b <= B`` nodes in best-first order, each after its
        parent) with the anchor at position ``start``, node ``i`` at ``start + 1 + depth[i]`` under
        ``parent[i]``: ``(features [1, 1 + b, k*H], logits [1 + b, V])``, views of static buffers
        valid until the next step.

        Raises:
            ValueError: more nodes than the budget, or positions past the cache's capacity.
        """
        b, w = len(parent), self.width
        if b + 1 > w:
            raise ValueError(f"a tree of {b} nodes in a step built for {w - 1}")
        if start + w > self.capacity:
            raise ValueError(f"positions {start}..{start + w - 1} exceed the static cache's capacity {self.capacity}")
        self.anc.copy_(ancestors(parent, w))
        self.depth.copy_(torch.tensor([0] + [d + 1 for d in depth] + [0] * (w - 1 - b)))
        self.ids[0, : b + 1] = ids
        self.start.fill_(start)
        f, logits = self.tree_step()
        return f[:, : b + 1], logits[: b + 1]

    @torch.no_grad()
    def keep_path(self, start: int, rows: torch.Tensor) -> None:
        """Move the tree rows ``rows`` (``[1 + m]`` int64, increasing, row 0 the anchor) to slots
        ``start .. start + m``, in every layer."""
        src = rows + start
        dst = torch.arange(start, start + rows.shape[0], device=rows.device)
        self.k[:, :, :, dst] = self.k[:, :, :, src]
        self.v[:, :, :, dst] = self.v[:, :, :, src]


# target -> {(budget, graphs): an idle StaticTreeTarget}; weak, so a dropped target frees them
_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def acquire(target: Target, budget: int, capacity: int, graphs: bool = True) -> StaticTreeTarget:
    """A :class:`StaticTreeTarget` for trees of ``budget`` nodes with room for ``capacity`` positions:
    the last one released for this target, budget and ``graphs`` when it has the room and the
    weights have not moved, else a new one (capacity rounded up as
    :func:`dflash.eval.static_target.acquire` does).

    Raises:
        UnsupportedTarget: as :func:`dflash.eval.static_target.check_supported`.
    """
    run = _POOL.get(target, {}).pop((budget, graphs), None)
    if run is not None and run.capacity >= capacity + budget + 1 and run.weights == weights_signature(target.model):
        return run
    run = StaticTreeTarget(target, budget, rounded_capacity(capacity + budget + 1), graphs)
    run.owner = weakref.ref(target)
    return run


def pooled(target: Target, budget: int, graphs: bool = True) -> StaticTreeTarget | None:
    """The idle :class:`StaticTreeTarget` of ``target`` and ``budget`` (the last generation's), if any."""
    return _POOL.get(target, {}).get((budget, graphs))


def release(run: StaticTreeTarget) -> None:
    """Hand ``run`` (from :func:`acquire`) back for the next generation of its target and budget."""
    target = run.owner() if run.owner is not None else None
    if target is not None:
        _POOL.setdefault(target, {})[(run.width - 1, run.asked_graphs)] = run
