"""The resolved nodes of a :class:`csp.Graph`: a process with its class and decoded options, a channel."""

from __future__ import annotations

from typing import Any

import msgspec


class ProcessNode(msgspec.Struct, kw_only=True):
    """A resolved process: class, decoded options, replicas, devices, wiring."""

    name: str
    cls: type
    options: Any
    replicas: int = 1
    devices: list[str | None] = []
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    index: int = 0  # position in the file, for error paths
    ranks: list[int] | None = None  # csp.distributed placement, one rank per replica

    @property
    def kind(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


class ChannelNode(msgspec.Struct, kw_only=True):
    """A channel of the graph (name, capacity, ordered)."""

    name: str
    capacity: int
    ordered: bool = False
    rank_local: bool = False  # csp.distributed: one copy of the channel per rank


__all__ = ["ChannelNode", "ProcessNode"]
