"""The loss-spike rule shared by the live monitor (:mod:`dflash.run.stages.monitor`) and
``python -m dflash.logs``: Hampel's identifier on the recent finite window losses.

A loss is a spike when it exceeds ``median + k * max(1.4826 * MAD, rel_floor * |median|)`` of the
previous ``window`` finite losses (at least ``min_history`` of them). The factor 1.4826 makes the
median absolute deviation (MAD) estimate a standard deviation for normal noise (Rousseeuw & Croux
1993); the floor keeps a perfectly flat loss from flagging noise.
"""

from __future__ import annotations

import statistics

__all__ = ["MAD_TO_STD", "spike_threshold"]

MAD_TO_STD = 1.4826


def spike_threshold(history: list[float], *, window: int = 20, k: float = 5.0, rel_floor: float = 0.01,
                    min_history: int = 5) -> tuple[float, float] | None:
    """``(median, threshold)`` of the last ``window`` finite losses, or None with too little history.

    A loss above ``threshold = median + k * max(1.4826 * MAD, rel_floor * |median|)`` is a spike.
    """
    recent = history[-window:]
    if len(recent) < min_history:
        return None
    med = statistics.median(recent)
    mad = statistics.median(abs(x - med) for x in recent)
    return med, med + k * max(MAD_TO_STD * mad, rel_floor * abs(med))
