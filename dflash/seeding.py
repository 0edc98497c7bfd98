"""One seed mixer: the seed of a random stream from the run seed and a key.

Every random stream of a run is a pure function of ``[run].seed`` and a key (a batch id, a
parameter name), never of the order things are built or run in, so a resumed run, or one with a
different number of steps, draws exactly the numbers the uninterrupted run drew.

Streams that share a kind of key use different salts: anchors
(:func:`dflash.run.stages.prefetch.anchor_generator`) and feature noise (:func:`dflash.model.features.apply_feature_noise`) are both keyed by the batch id, and
with one salt batch ``b``'s noise generator would be seeded exactly like its anchor generator, so
the two "independent" draws would come from the same sequence. With the noise salt and key
``batch_id + 1`` the two seeds of one batch differ by ``seed * 6_000_000 + 1`` (mod 2**63), an odd
number, so they never coincide. The salts are fixed: changing one
changes every run's numbers (``tests/dflash/test_seeding.py`` pins the values).
"""

from __future__ import annotations

import zlib

__all__ = ["ANCHORS", "FEATURE_NOISE", "PARAMS", "derive_seed"]

ANCHORS = 1_000_003
"""Salt of the anchor stream (key: batch id)."""
PARAMS = 1_000_003
"""Salt of a random target's per-parameter init (key: the parameter name). It equals the anchor
salt for historical reasons; the keys are of another kind (crc32 of a name vs a batch id), and a
chance equality would only pair one weight's init with one batch's anchors."""
FEATURE_NOISE = 7_000_003
"""Salt of the feature-noise stream (key: batch id + 1)."""


def derive_seed(seed: int, key: int | str, *, salt: int = ANCHORS) -> int:
    """``(seed * salt + key) % 2**63``, a seed for ``torch.Generator.manual_seed``.

    Args:
        seed: the run seed (``[run].seed``).
        key: what the stream is for: an int (a batch id), or a str, mixed in as its CRC-32
            (``zlib.crc32`` of the UTF-8 bytes), so the value is stable across processes (unlike
            ``hash``).
        salt: the stream's multiplier (one of the constants above).

    Returns: an int in ``[0, 2**63)``.
    """
    k = zlib.crc32(key.encode()) if isinstance(key, str) else key
    return (seed * salt + k) % (2**63)
