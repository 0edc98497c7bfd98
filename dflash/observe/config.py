"""The graph file's ``[monitor]`` table (windows, wandb, the display, spikes, the plot) and its one
check: a wandb backend that is not installed.

The monitor stage and the run's reports own these settings; :func:`check_monitor` runs once the run
is resolved, before any data is read, so a missing wandb is one line instead of a failure at step 0.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

from msgspec import Meta

from dflash.errors import ConfigError
from dflash.tables import PositiveInt, Table

__all__ = ["MonitorSection", "check_monitor"]



class MonitorSection(Table):
    """``[monitor]``: metrics windows and sinks."""

    window: PositiveInt = 10
    """Steps per logged point; every point records its window size."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode: "offline" (files under RUN_DIR/wandb, no network; ``wandb sync`` uploads them),
    "online" (needs ``wandb login``) or "disabled"."""
    wandb_project: str = "dflash"
    """The wandb project the run is logged to."""
    display: Literal["auto", "live", "plain", "off"] = "auto"
    """"auto": a rich live view on a terminal, plain lines otherwise."""
    spike_k: Annotated[float, Meta(gt=0.0)] = 5.0
    """A window whose loss exceeds the median of the last 20 windows by spike_k robust standard
    deviations (1.4826 x MAD) is flagged as a spike (the rule of python -m dflash.logs)."""
    plot: bool = True
    """At the end of the run write RUN_DIR/plot.png (python -m dflash.plot); where matplotlib is not
    importable, the summary's plot line says how to draw it."""


def check_monitor(monitor: MonitorSection) -> None:
    """``[monitor].wandb`` other than "disabled" needs an importable ``wandb``.

    Raises:
        ConfigError: wandb is not installed (the caller runs this only when the graph has a monitor).
    """
    if monitor.wandb != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"monitor.wandb = {monitor.wandb!r} needs the wandb package, which is not installed; set "
            "monitor.wandb = \"disabled\" (--set monitor.wandb=disabled) or pip install wandb")
