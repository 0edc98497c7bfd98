"""Small builders shared by tests."""

from __future__ import annotations

import threading
import time
from importlib import metadata

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


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2, CUDA only):
    per-sequence causal SDPA in the varlen layout ``q [T, h, d]``, ``k, v [T, kv_h, d]`` (GQA by
    repeat), sequences ``cu_q [N + 1]``; only the causal window ``(-1, 0)`` the target uses."""
    import torch.nn.functional as F

    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k)
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def save_checkpoint(directory, drafter, drafter_cfg, target_cfg, *, step: int = 1, healthy: bool = True) -> None:
    """A minimal complete checkpoint in the existing ``directory``: the drafter's weights and
    configs (:func:`dflash.checkpoint.model_files.save_drafter`) and the ``meta.json`` every
    finished save ends with, which the readers (eval, export) require."""
    from pathlib import Path

    import msgspec

    from dflash.checkpoint import META, Meta
    from dflash.checkpoint.model_files import save_drafter

    save_drafter(directory, drafter, drafter_cfg, target_cfg)
    meta = Meta(step=step, batch_id=step - 1, loss=1.0, window_steps=1, healthy=healthy,
                reason=None if healthy else "planted by a test")
    (Path(directory) / META).write_bytes(msgspec.json.encode(meta))


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` is installed (its data files can be located)."""
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True
