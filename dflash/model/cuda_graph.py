"""One decode step replayed as a CUDA graph, falling back to running it eagerly.

:class:`GraphedStep` wraps a function of no arguments that reads and writes only static buffers
(fixed shapes and addresses; no value read back to the host, no Python branch on a tensor's
value). On CUDA its first call captures it as a ``torch.cuda.CUDAGraph`` and every later call is
one replay; elsewhere, or when the capture fails, it is called eagerly (the failure logged once,
with its reason). The caller copies a step's inputs into the buffers before each call and reads
the outputs before the next: a replay overwrites them in place.

The capture follows PyTorch's CUDA graph notes: a few warm-up calls on a side stream (lazy
initialisation, e.g. cuBLAS workspaces, must not be captured), then ``torch.cuda.graph``. The
warm-ups run the real step on the current inputs, so the step must be idempotent: writing the
same values to the same slots again (a KV-cache write at fixed positions is).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

__all__ = ["GraphedStep", "weights_signature"]

log = logging.getLogger(__name__)

WARMUPS = 2


def weights_signature(*modules: torch.nn.Module) -> tuple:
    """Where and in what dtype every parameter and buffer of ``modules`` lives. A graph replays
    reads of the addresses it was captured with: after ``.to(...)`` or a reload these change, and
    a replay would read freed memory; a step kept for reuse is rebuilt when this differs."""
    return tuple((t.data_ptr(), t.dtype) for m in modules for t in (*m.parameters(), *m.buffers()))


class GraphedStep:
    """``step()``: ``fn()``'s outputs, from a CUDA-graph replay once captured.

    Args:
        fn: the step over static buffers (module docstring); returns its output tensors. A bound
            method is held weakly: its object owns this step (``obj.step = GraphedStep(obj._step,
            ...)``), and a strong reference would be a cycle that keeps the object's KV cache and
            graph alive after its last user drops it, until the cycle collector happens to run.
        graphs: capture on the first call (when ``cuda``); False: always eager.
        cuda: whether the buffers live on a CUDA device.
        what: names the step in the fallback's log line (e.g. "the target's 16-token step").
    """

    def __init__(self, fn: Callable[[], object], graphs: bool, cuda: bool, what: str) -> None:
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") and hasattr(fn, "__func__") else (lambda: fn)
        self.what = what
        self.graphs = graphs and cuda
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None  # the captured call's outputs: the replays write them

    def fn(self):
        """Run the step eagerly (its owner is alive: it holds this step)."""
        return self._fn()()

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if self.graphs:
            try:
                self._capture()
                self.graph.replay()
                return self.out
            except Exception as exc:  # noqa: BLE001 - whatever refused the capture, the eager step works
                self.graph, self.graphs = None, False
                why = str(exc).splitlines()[0] if str(exc) else ""
                log.warning("dflash: CUDA graph capture of %s failed (%s: %s); running it eagerly",
                            self.what, type(exc).__name__, why)
        return self.fn()

    def reset(self) -> None:
        """Forget the graph (the buffers it reads were reallocated); the next call captures again."""
        self.graph, self.out = None, None

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUPS):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.fn()
        self.graph = graph
