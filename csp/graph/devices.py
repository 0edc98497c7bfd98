"""Device probing for graph validation: is ``"cpu"`` / ``"cuda:N"`` a device this machine has?"""

from __future__ import annotations

from csp.errors import GraphError


def check_device(where: str, dev: str | None) -> None:
    """Check one replica's device; ``where`` names the process in the message.

    Raises:
        GraphError: ``dev`` is not None, ``"cpu"`` or ``"cuda:N"``, torch is missing for a CUDA
            device, or index N is not below this machine's CUDA device count.
    """
    if dev is None or dev == "cpu":
        return
    kind, _, index = dev.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise GraphError(f"{where}: device {dev!r} is not 'cpu', 'cuda' or 'cuda:N'")
    try:
        import torch
    except ImportError:
        raise GraphError(f"{where}: device {dev!r} needs torch, which is not installed") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(index) >= count:
        raise GraphError(
            f"{where}: device {dev!r} does not exist (this machine has {count} CUDA device(s)); "
            "use an index below that or 'cpu'"
        )


__all__ = ["check_device"]
