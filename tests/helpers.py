"""Small builders shared by tests."""

from __future__ import annotations

import threading
import time

import torch

from dflash.messages import Batch


def make_batch(T: int = 4, batch_id: int = 0, seq: int = 0) -> Batch:
    """A one-row batch of T tokens, one document, loss on every token."""
    return Batch(
        seq=seq,
        batch_id=batch_id,
        epoch=0,
        input_ids=torch.arange(T).unsqueeze(0),
        loss_mask=torch.ones(1, T, dtype=torch.bool),
        position_ids=torch.arange(T).unsqueeze(0),
        doc_ids=torch.zeros(1, T, dtype=torch.int32),
        num_tokens=T,
        num_padding=0,
    )


def wait_until(pred, timeout: float = 5.0) -> None:
    """Poll ``pred`` until true (a bounded wait for another thread's state, not an ordering sleep)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.0005)


def start(fn, *args) -> threading.Thread:
    """Start ``fn(*args)`` in a daemon thread."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def joined(t: threading.Thread, timeout: float = 10.0) -> None:
    """Join ``t``, failing the test if it is still alive after ``timeout`` seconds."""
    t.join(timeout)
    assert not t.is_alive(), "thread did not finish"
