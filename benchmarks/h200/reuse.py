"""Reuse of the frozen models across benchmark runs in one process.

Building a random-init 8B target, its 2 x 622M-entry embedding and LM head (drawn on the CPU) and
a 1B-parameter drafter (initialised on the CPU, then moved) for every benchmark run would cost
~20 s per run. Inside ``with ModelReuse():`` the stages get the already built frozen
target and shared head (memoised by their arguments) and the drafter is initialised directly on the
stage's current CUDA device. Only set-up time changes; every timed step runs the stages' own code.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from typing import Any

import msgspec
import torch


def _key(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return msgspec.json.encode(value)
    if isinstance(value, (torch.device, torch.dtype)):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


class ModelReuse:
    """Context manager: the DFlash stages reuse frozen models across runs in this process.

    Patches, undone on exit: ``dflash.run.stages.target.load_target`` and ``dflash.model.target.load_shared_head``
    /``_random_head`` are memoised by their (normalised) arguments; ``dflash.model.drafter.DFlashDrafter``
    is built under ``torch.device(current CUDA device)`` (the csp runtime makes the stage's device
    current). A patch whose target no longer exists is skipped and listed in :attr:`missing`.

    Attributes:
        builds, hits: per memoised function, calls that built / reused a model.
        original_load_target: the unpatched :func:`dflash.model.target.load_target`.
        load_target: the memoised one (what the target stage calls).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cache: dict[Any, Any] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self.builds: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.missing: list[str] = []

    def _memo(self, name: str, fn: Any, key_of: Any = None) -> Any:
        """``fn`` memoised by its bound arguments (``key_of(arguments)`` when given)."""
        sig = inspect.signature(fn)

        def memoised(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            args_key = key_of(bound.arguments) if key_of else tuple((k, _key(v)) for k, v in bound.arguments.items())
            key = (name, args_key)
            with self._lock:
                if key in self._cache:
                    self.hits[name] += 1
                    return self._cache[key]
                self.builds[name] += 1
                out = self._cache[key] = fn(*args, **kwargs)
                return out

        memoised.__wrapped__ = fn  # type: ignore[attr-defined]
        return memoised

    def _patch(self, module: Any, attr: str, make: Any) -> Any:
        if not hasattr(module, attr):
            self.missing.append(f"{module.__name__}.{attr}")
            return None
        old = getattr(module, attr)
        new = make(old)
        self._undo.append((module, attr, old))
        setattr(module, attr, new)
        return new

    def __enter__(self) -> "ModelReuse":
        import dflash.model.drafter as drafter_mod
        import dflash.model.target as target_mod
        import dflash.run.stages.target as target_stage

        self.original_load_target = target_mod.load_target
        self._patch(target_mod, "_random_head", lambda f: self._memo("random_head", f, _head_key))
        self._patch(target_mod, "load_shared_head", lambda f: self._memo("shared_head", f))
        self.load_target = self._patch(target_stage, "load_target", lambda f: self._memo("target", f))
        if self.load_target is None:
            self.load_target = self._memo("target", target_mod.load_target)
        self._patch(drafter_mod, "DFlashDrafter", _built_on_current_device)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, old in reversed(self._undo):
            setattr(module, attr, old)
        self._undo.clear()
        self._cache.clear()

    def report(self) -> dict[str, Any]:
        return {"builds": dict(self.builds), "hits": dict(self.hits), "missing_patches": self.missing}


def _head_key(arguments: dict[str, Any]) -> tuple:
    """What the random embedding/LM head depend on (a transformers config's repr gains fields once a
    model was built from it, so the config itself is no key)."""
    hf, seed = arguments.get("hf_config"), arguments.get("seed")
    if hf is None or not hasattr(hf, "vocab_size"):  # signature changed: key by every argument
        return tuple((k, _key(v)) for k, v in arguments.items())
    return (hf.vocab_size, hf.hidden_size, getattr(hf, "initializer_range", None),
            bool(getattr(hf, "tie_word_embeddings", False)), seed)


def _built_on_current_device(cls: type) -> type:
    """A subclass of the drafter class whose parameters are created (and initialised) directly on
    the current CUDA device instead of on the CPU and then moved."""

    class OnDevice(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            cuda = torch.cuda.is_available()
            with torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"):
                super().__init__(*args, **kwargs)

    OnDevice.__name__ = OnDevice.__qualname__ = cls.__name__
    OnDevice.__module__ = cls.__module__
    return OnDevice
