"""The projected decode speedup of a drafter on an 8B-class target, from its measured tau.

Batch-1 greedy speculative decoding emits ``tau`` tokens per verify step, where plain decoding
emits one per target forward, so ``speedup = tau * t_greedy / (t_verify(bs) + t_draft) = tau / c``
(``benchmarks/decode/projection.py`` derives it and checks ``c`` against z-lab's published
Qwen3-8B points, whose implied ``c`` is 1.26 and 1.52).

:data:`QWEN3_8B_H200` is ``c`` measured there for the public Qwen3-8B shape (random-init weights:
speed needs no trained ones), bf16, one H200, a 3-layer drafter at block 16 and a 512-token
context: ``t_greedy`` 30.2 ms, ``t_verify(16)`` 34.3 ms, ``t_draft`` 4.1 ms
(``benchmarks/results/decode_projection_h200.json``, 2026-12-01, ``python -m
benchmarks.decode.projection --tau 2.44,3.40,3.92 --reps 5 --drafter-layers 3``). The projection
ignores host work between forwards and holds for drafters of that depth and block size; it is
printed as a projection, never as a measurement.
"""

from __future__ import annotations

from dflash.eval.report import Projection

__all__ = ["QWEN3_8B_H200", "project_8b"]

QWEN3_8B_H200 = 1.2728
"""``c = (t_verify(16) + t_draft) / t_greedy`` at the Qwen3-8B shape on one H200 (bf16, 3-layer drafter)."""

BASIS = "Qwen3-8B, bf16, one H200, a 3-layer drafter at block 16 (benchmarks/decode/projection.py)"


def project_8b(tau: float) -> Projection:
    """The projected speedup at tokens-per-verify-step ``tau`` on Qwen3-8B / H200 (``tau / c``)."""
    return Projection(speedup=tau / QWEN3_8B_H200, cost_ratio=QWEN3_8B_H200, basis=BASIS)
