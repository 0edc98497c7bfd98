"""Human-readable numbers for reports: ``37K items/s``, ``1.2 GB/s``, ``0.05 items/s``.

SI prefixes (K = 10^3, M, G, T; bytes use kB, MB, GB, TB as rich's ``filesize.decimal`` does).
Below 10 of a unit one decimal is kept (``3.7K``, ``1.2 GB``), from 10 on none (``37K``,
``374 MB``); below 1000 plain numbers keep two significant digits under 10 (``9.5``, ``0.05``).
"""

from __future__ import annotations

import math

_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))


def _scaled(x: float, prefixes: tuple[tuple[str, float], ...], sep: str) -> str:
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return f"0{sep}"
    for prefix, scale in prefixes:
        if abs(x) >= scale * 0.9995:  # 999.96 rounds up to the next prefix, not to "1000K"
            v = x / scale
            return f"{v:.1f}{sep}{prefix}" if abs(v) < 9.95 else f"{v:.0f}{sep}{prefix}"
    return f"{x:.2g}{sep}" if abs(x) < 10 else f"{x:.0f}{sep}"


def count(x: float) -> str:
    """A count or rate without unit: ``37K``, ``1.2M``, ``410``, ``9.5``, ``0``."""
    return _scaled(x, _PREFIXES, "")


def rate(x: float, unit: str = "items") -> str:
    """``count(x)`` followed by `` {unit}/s``: ``37K items/s``."""
    return f"{count(x)} {unit}/s"


def bytes_rate(x: float) -> str:
    """Bytes per second: ``1.2 GB/s``, ``374 kB/s``, ``12 B/s``, ``0 B/s``."""
    text = _scaled(x, (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)), " ")
    return f"{text}B/s"


__all__ = ["bytes_rate", "count", "rate"]
