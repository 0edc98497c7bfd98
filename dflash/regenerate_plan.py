"""How ``dflash.regenerate`` sizes its work: the engine, rows and chunk for the device and target
(:func:`choose_engine`), and chunk sizes that end by a deadline (:class:`ChunkPlanner`,
``--time-limit``).

A chunk of conversations is the unit that ``dflash.regenerate`` writes together: a chunk cut off by
a kill is redone in full on resume, so a run stopped from outside (``timeout``, a device call's
limit) loses the work of the chunk in flight, minutes of it on a GPU at thousands of conversations
a chunk. With a deadline the run instead starts no chunk it does not expect to finish: the first
chunk is one batch of rows (a measurement), each later one is sized from the seconds per
conversation of the chunk before it to fit the time left (with a margin), and the run stops, with
everything it answered written, when not even one batch of rows fits. The time after that stop is
what the limit leaves unused: less than one batch's worth.

Stdlib only at import (``dflash.regenerate``'s ``--help`` stays quick); torch is imported where used.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

__all__ = ["ChunkPlanner", "choose_engine"]


class ChunkPlanner:
    """Sizes each chunk of a regeneration so that it ends before ``deadline`` (or plainly without one).

    Args:
        chunk: the largest chunk, in conversations (``--chunk``).
        batch_size: rows answered at once (``--batch-size``): the first chunk under a deadline, and
            the smallest chunk worth starting (a chunk of fewer rows than the engine answers at once
            costs about as long as a full batch, so its time cannot be planned from the rate).
        deadline: the ``clock()`` value by which the last chunk must have ended; None: no deadline.
        margin: the share of the time left that a planned chunk may fill (the rate of the next
            chunk differs from the last one's: longer prompts, later turns).
        clock: seconds, the clock ``deadline`` is on (default ``time.monotonic``).

    Raises:
        ValueError: ``chunk`` or ``batch_size`` < 1, or ``margin`` outside (0, 1].
    """

    def __init__(self, chunk: int, batch_size: int, deadline: float | None = None, margin: float = 0.8,
                 clock: Callable[[], float] | None = None) -> None:
        if chunk < 1 or batch_size < 1 or not 0 < margin <= 1:
            raise ValueError(f"chunk ({chunk}) and batch_size ({batch_size}) must be >= 1 and margin "
                             f"({margin}) in (0, 1]")
        self.chunk, self.batch_size, self.deadline, self.margin = chunk, batch_size, deadline, margin
        self.clock = clock or time.monotonic
        self.seconds_per_conversation: float | None = None  # of the last chunk that finished
        self.stopped = False                                # True once the deadline ended the run early
        self.conversations_done = 0                         # in the chunks that finished

    def next_size(self, left: int) -> int:
        """Conversations in the next chunk, out of ``left`` still to answer; 0 when the run stops
        here (nothing left, or the deadline: then ``stopped`` is True)."""
        if left <= 0:
            return 0
        if self.deadline is None:
            return min(self.chunk, left)
        remaining = self.deadline - self.clock()
        if self.seconds_per_conversation is None:
            size = min(self.chunk, self.batch_size, left) if remaining > 0 else 0
        else:
            size = min(self.chunk, left, int(self.margin * remaining / self.seconds_per_conversation))
            if size < min(self.batch_size, left):
                size = 0
        self.stopped = size == 0
        return size

    def finished(self, size: int, seconds: float) -> None:
        """Record that a chunk of ``size`` conversations took ``seconds`` (wall clock, start to write)."""
        if size > 0:
            self.seconds_per_conversation = max(seconds, 1e-9) / size
            self.conversations_done += size


def choose_engine(args: argparse.Namespace, model, device) -> str:
    """Make ``--engine auto`` and an unset ``--batch-size`` / ``--chunk`` concrete for this device
    and target (``args`` is updated in place); returns what was chosen, in words, for the start line.

    auto is the slots engine (:mod:`dflash.model.slots`: 4.3x ``generate`` on an H100 with
    SmolLM2-135M-Instruct) on a GPU for a target it runs, else ``generate`` (a CPU, or a family or
    attention the slots engine does not reproduce: the reason is said). The slots engine's rows on a
    GPU fill half its free memory with KV cache for the longest context and answer
    (:func:`dflash.model.slots.rows_that_fit`, at most 512); its chunk is 8 rows' worth of
    conversations, so that refilled rows stay busy to the chunk's end.

    Raises:
        ValueError: ``--engine slots`` for a target it does not run (one line, what to use instead).
    """
    import torch

    from dflash.model.slots import (
        USE_GENERATE,
        check_model,
        positions_for,
        rows_that_fit,
    )

    gpu = str(device).startswith("cuda")
    why = ""
    if args.engine == "auto":
        args.engine, why = "generate", " (auto: a CPU)"
        if gpu:
            try:
                check_model(model)
                args.engine, why = "slots", " (auto: a GPU)"
            except ValueError as e:
                why = f" (auto: {str(e).removesuffix(USE_GENERATE)})"
    elif args.engine == "slots":
        check_model(model)
    sized = ""
    if args.batch_size is None:
        args.batch_size = 32
        if args.engine == "slots" and gpu:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            args.batch_size = rows_that_fit(model, positions_for(args.max_prompt_tokens, args.max_new_tokens), free)
            sized = f", sized to half of the GPU's free {free / 2**30:.1f} GiB"
    if args.chunk is None:
        args.chunk = 8 * args.batch_size if args.engine == "slots" else 64
    return (f"engine {args.engine}{why}, at most {args.batch_size} rows at once{sized}, chunks of {args.chunk} "
            "conversations")
