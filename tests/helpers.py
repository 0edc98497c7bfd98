"""Small builders shared by tests."""

from __future__ import annotations

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
