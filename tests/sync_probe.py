"""Count the operations that would make the host wait for the GPU, on CPU tensors.

On CUDA these block the host until the device has caught up (``torch.cuda.set_sync_debug_mode``
reports the same kinds): reading a value (``item``, ``int()``, ``float()``, ``bool()``, which all
reach ``aten._local_scalar_dense``; ``tolist``, ``numpy``), and every op whose *output shape*
depends on tensor values (``nonzero``, ``masked_select``, boolean-mask indexing and assignment,
``unique``, ``repeat_interleave`` without ``output_size``). A ``TorchDispatchMode`` sees the aten
ops whatever Python spelling called them; ``tolist``/``numpy`` read memory without an aten op and
are wrapped directly.

Usage::

    with SyncProbe() as probe:
        step()
    assert probe.syncs == []          # or the documented ones
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_ALWAYS = {
    _aten._local_scalar_dense.default: "read a value (item/int/float/bool)",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.unique_dim.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.repeat_interleave.Tensor: "repeat_interleave (data-dependent size)",
}
_BOOL_INDEX = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
               _aten._index_put_impl_.default}


def _where() -> str:
    """Who asked for the sync: the innermost frame outside torch and this file, then (after ``|``)
    the torch files on the way there, innermost first (e.g. ``torch/optim/adamw.py``)."""
    inner: list[str] = []
    for fr in reversed(traceback.extract_stack()):
        if fr.filename.endswith("sync_probe.py") or "/torch/utils/_python_dispatch" in fr.filename:
            continue
        if "/torch/" in fr.filename:
            name = "torch/" + fr.filename.rsplit("/torch/", 1)[1]
            inner += [] if name in inner else [name]
            continue
        return f"{'/'.join(fr.filename.rsplit('/', 2)[-2:])}:{fr.lineno} {fr.line} |{','.join(inner)}"
    return f"? |{','.join(inner)}"


def device_syncs(syncs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``syncs`` less the reads of AdamW's step counts: torch keeps those on the host (not
    ``capturable``, not fused), so on CUDA they never wait for the device."""
    return [s for s in syncs if "torch/optim/" not in s[1].rsplit("|", 1)[-1]]


class SyncProbe(TorchDispatchMode):
    """Records ``(kind, where)`` for every host-syncing operation run inside the ``with``."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _ALWAYS.get(func)
        if kind is None and func in _BOOL_INDEX:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx):
                kind = "boolean-mask indexing"
        if kind is not None:
            self.syncs.append((kind, _where()))
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapped(t, *a, _orig=orig, _name=name, **k):
                self.syncs.append((_name, _where()))
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        self._saved.clear()
        return super().__exit__(*exc)
