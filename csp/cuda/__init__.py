"""Tensors in channels: the one walker over nested items and the event-ordered CUDA hand-off.

It imports only :mod:`csp.errors`, never torch at import time (torch is looked up in
``sys.modules``), so a channel that never carries a tensor works without torch. This
``__init__`` imports nothing. Modules::

    tensors.py     map_tensors(), iter_tensors(): where the tensors of a nested item sit (byte
                   counts, device moves, the non-finite sentinel, checkpoint snapshots)
    handoff.py     what a channel does with CUDA tensors on send and receive: one event per device
                   recorded on the sender's stream and waited on by the receiver's, record_stream so
                   the caching allocator keeps the memory alive; device moves; the pinned-buffer pool
"""
