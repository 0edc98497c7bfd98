"""Tensors in channels: the one walker over nested items and the event-ordered CUDA hand-off.

Owns :mod:`csp.cuda.tensors` (``map_tensors`` / ``iter_tensors``: where the tensors of a nested
item sit, used for byte counts, device moves, the non-finite sentinel and checkpoint snapshots)
and :mod:`csp.cuda.handoff` (what a channel does with CUDA tensors on ``send`` and ``receive``:
one event per device recorded on the sender's stream, waited on by the receiver's, and
``record_stream`` so the caching allocator keeps the memory alive; device moves; the bounded
pinned-buffer pool). It imports only :mod:`csp.errors`, never torch at import time (torch is
looked up in ``sys.modules``), so a channel that never carries a tensor works without torch.
This ``__init__`` imports nothing.
"""
