"""Atomic, durable writes of the checkpoint format's small files: JSON (fsynced), the rewrite of a
``meta.json`` (:func:`mark_unhealthy`) and the per-replica state files of a data-parallel run.

Every file is fsynced before it counts. :func:`mark_unhealthy` and :func:`write_rank_state` write a
temporary name and rename it over the target, so a crash leaves the old file or the new one, never
half of one; :func:`write_json` writes in place (the writer uses it inside its ``.tmp-`` directory,
which is renamed as a whole).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import torch

from dflash.checkpoint.format import META, TMP_PREFIX, rank_state_path, read_meta

__all__ = ["current_umask", "device_of", "fsync_dir", "mark_unhealthy", "usual_mode", "write_json",
           "write_rank_state"]


def device_of(path: Path) -> str:
    """The filesystem holding ``path`` (or its nearest existing parent), for error lines:
    ``"/dev/sda1 (mounted at /data)"``, from ``/proc/self/mounts``; ``"the filesystem at MOUNT"``
    where that is unreadable. Never raises."""
    try:
        p = Path(os.path.abspath(path))
        while not p.exists() and p != p.parent:
            p = p.parent
        mount = p
        while not os.path.ismount(mount) and mount != mount.parent:
            mount = mount.parent
    except (OSError, ValueError):
        return f"the filesystem of {path}"
    source = None
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[1] == str(mount):
                source = fields[0]  # the last entry for a mount point is the one in effect
    except OSError:
        pass
    return f"{source} (mounted at {mount})" if source else f"the filesystem at {mount}"


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in directory ``path`` durable (best effort: errors are ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``os.umask`` sets it, and
    a thread creating a file meanwhile would get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def usual_mode(*files: Path) -> None:
    """Give files the mode ``open()`` would (``0o666 & ~umask``, 0644 under umask 022):
    safetensors writes them 0600, unreadable by the user's group."""
    mode = 0o666 & ~current_umask()
    for f in files:
        os.chmod(f, mode)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(obj), indent=2))
        f.flush()
        os.fsync(f.fileno())



def mark_unhealthy(path: Path, reason: str) -> None:
    """Rewrite ``meta.json`` of a checkpoint with ``healthy: false`` and ``reason`` (atomically:
    a temporary file renamed over it). No-op when it has no readable meta.json."""
    meta = read_meta(path)
    if meta is None:
        return
    meta.update(healthy=False, reason=reason)
    tmp = path / ".meta.json.tmp"
    write_json(tmp, meta)
    os.replace(tmp, path / META)
    fsync_dir(path)



def write_rank_state(ckpt_root: str | Path, step: int, replica: int, state: dict[str, Any]) -> Path:
    """Write replica ``replica``'s ``state`` (``torch.save``-able) to :func:`rank_state_path`
    atomically (temporary file, fsync, rename). Returns the file. Raises OSError."""
    path = rank_state_path(ckpt_root, step, replica)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
