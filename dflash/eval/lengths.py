"""Context-length buckets: tau by how long the context was when the drafter drafted.

A drafter trained on short conversations can lose acceptance on long prompts (its attention and
the target's features at positions it never saw); a pooled tau hides that. Each decode is put in
the bucket of its prompt's length in tokens (a later turn's prompt holds the earlier turns), with
edges at 1K, 4K, 8K, 16K and 32K tokens (K = 1,024), the ranges long-context reports use.
"""

from __future__ import annotations

__all__ = ["EDGES", "LABELS", "length_bucket"]

EDGES = (1024, 4096, 8192, 16384, 32768)
"""Bucket boundaries in tokens: a prompt of exactly an edge's length opens the next bucket."""


def _k(n: int) -> str:
    return f"{n // 1024}K"


LABELS = (f"<{_k(EDGES[0])}", *(f"{_k(a)}-{_k(b)}" for a, b in zip(EDGES, EDGES[1:])), f">={_k(EDGES[-1])}")
"""The buckets' names, shortest first: ``<1K``, ``1K-4K``, ``4K-8K``, ``8K-16K``, ``16K-32K``, ``>=32K``."""


def length_bucket(tokens: int) -> str:
    """The bucket name (one of :data:`LABELS`) of a prompt of ``tokens`` tokens."""
    return LABELS[sum(tokens >= e for e in EDGES)]
