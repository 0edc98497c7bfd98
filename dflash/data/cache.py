"""On-disk cache of tokenized datasets: one directory per key, flat ``.npy`` arrays + meta.json.

Layout of ``CACHE_DIR/<key>/``: ``tokens.npy`` (int32), ``loss_mask.npy`` (uint8),
``offsets.npy`` (int64), ``source_index.npy`` (int64, record index in the source file of each
conversation), ``meta.json`` (the key's inputs and the load summary). An entry is written into a
temporary sibling directory and renamed into place, so a crash never leaves a half entry and two
writers of the same key cannot corrupt each other (the second rename loses, harmlessly).
Reload memory-maps the arrays: it takes well under a second whatever the size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

CACHE_VERSION = 3
"""Bumped whenever the tokenization code changes what it produces; part of every key (3: the
reader keeps the rows after a JSONL file's array first row, which version 2 cached without)."""

ARRAYS = ("tokens", "loss_mask", "offsets", "source_index")


def cache_key(parts: dict[str, Any]) -> str:
    """A 24-hex-digit sha256 of ``parts`` (JSON, sorted keys) plus :data:`CACHE_VERSION`."""
    blob = json.dumps({"cache_version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load_entry(entry: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays (read-only memory maps) and meta of a complete entry, or None if absent or
    incomplete/corrupt (the caller then rebuilds it)."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    except (OSError, ValueError):
        return None
    if meta.get("cache_version") != CACHE_VERSION:
        return None
    return arrays, meta


def save_entry(entry: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write an entry atomically (see the module docstring)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        for name in ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(arrays[name]))
        (tmp / "meta.json").write_text(json.dumps({"cache_version": CACHE_VERSION, **meta}, indent=2))
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if load_entry(entry) is None:  # another writer did not win the race either
            raise
