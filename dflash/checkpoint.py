"""Atomic, non-stalling checkpoints of the drafter's training state, retention and resume.

Layout of one checkpoint (see docs/architecture.md)::

    RUN_DIR/checkpoints/step_00000100/
        model.safetensors     drafter weights (public DFlash parameter names)
        drafter_config.json   target_config.json
        train_state.safetensors  optimizer moments (and any other tensor of the train state)
        train_state.pt        the rest: scheduler, sampler and RNG state, step, references
        meta.json             {"step", "loss", "config_hash", "healthy", "time", "batch_id", "save_s"}

How a save avoids stalling the pipeline (failure mode 4 of DESIGN.md): the training thread only
*snapshots* the state — on CUDA a device-to-device clone on a side stream, ordered after the
optimizer step by an event; on CPU a clone — and a background writer thread does the slow part
(host copy, non-finite check, serialisation, fsync, rename). The trainer calls :meth:`Checkpointer.before_update`
before the next optimizer step so that step cannot overwrite parameters the copy still reads.

Atomicity: files go to ``.tmp-step_N`` and the directory is renamed to ``step_N`` only after
``meta.json`` (written last) is fsynced. A crash or Ctrl-C mid-save leaves a ``.tmp-*`` directory that
resume ignores and the next save removes. A snapshot with non-finite weights is never written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import save_file

log = logging.getLogger("dflash.checkpoint")

_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, read or trusted; the message says which and what to do."""


def step_dir(root: Path, step: int) -> Path:
    """``root/step_00000100`` for step 100."""
    return root / f"{_PREFIX}{step:08d}"


def _snapshot_tree(obj: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Copy every tensor in a nested dict/list/tuple structure with ``copy``; other leaves as is."""
    if isinstance(obj, torch.Tensor):
        return copy(obj)
    if isinstance(obj, dict):
        return {k: _snapshot_tree(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot_tree(v, copy) for v in obj)
    return obj


def _fsync_dir(path: Path) -> None:
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


def _current_umask() -> int:
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


def _usual_mode(*files: Path) -> None:
    """Give files the mode ``open()`` would (``0o666 & ~umask``, 0644 under umask 022):
    safetensors writes them 0600, unreadable by the user's group."""
    mode = 0o666 & ~_current_umask()
    for f in files:
        os.chmod(f, mode)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(obj), indent=2))
        f.flush()
        os.fsync(f.fileno())


class Snapshot(msgspec.Struct, kw_only=True):
    """Host copies of everything one checkpoint holds (filled by :meth:`Checkpointer.save`)."""

    step: int
    batch_id: int
    loss: float
    weights: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    configs: dict[str, Any]
    ready: Any = None  # torch.cuda.Event when the D2H copy is asynchronous, else None
    device: Any = None  # the CUDA device the copy was made from
    started: float = 0.0


class Checkpointer:
    """Writes checkpoints in a background thread, keeps the last ``keep_last`` healthy ones.

    Args:
        root: the ``checkpoints`` directory of the run.
        keep_last: how many complete healthy checkpoints to keep (older ones are deleted after a
            newer one is written).
        config_hash: hash of the resolved graph file, stored in ``meta.json``.
        on_event: called from the writer thread with a dict for ``metrics.jsonl``
            (``{"kind": "checkpoint", ...}``) after each save attempt.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep_last: int,
        config_hash: str,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-save
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.on_event = on_event or (lambda event: None)
        self._pending: Snapshot | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._copy_stream: Any = None
        self._d2h_stream: Any = None
        self._host: dict[str, torch.Tensor] = {}  # reused page-locked buffers of the host copy
        self._thread = threading.Thread(target=self._writer, name="dflash-checkpoint", daemon=False)
        self._thread.start()
        self.last_healthy: Path | None = None

    # -- training-thread side -------------------------------------------------------------------

    def save(
        self,
        *,
        step: int,
        batch_id: int,
        loss: float,
        weights: dict[str, torch.Tensor],
        train_state: dict[str, Any],
        configs: dict[str, Any],
    ) -> None:
        """Snapshot the state and hand it to the writer thread; returns without waiting for disk.

        ``weights`` and the tensors inside ``train_state`` may live on a CUDA device: they are
        copied to host memory on a side stream that first waits for the current stream, so the
        snapshot sees the state as of this call. Call :meth:`before_update` before modifying them.
        If the previous save is still being written, this waits for it (saves never pile up).
        """
        self.wait()
        cuda = any(t.is_cuda for t in weights.values())
        ready = device = None
        if cuda:
            # A device-to-device clone on a side stream: microseconds of host time and a few ms of
            # GPU copy bandwidth. The host copy and the serialisation happen in the writer thread
            # (torch copies release the GIL), so the training thread never waits for page-locking
            # or disk. Costs one extra copy of the state in GPU memory while a save is in flight.
            device = next(t.device for t in weights.values() if t.is_cuda)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=device)
            self._copy_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._copy_stream):
                weights = _snapshot_tree(weights, lambda t: t.detach().clone())
                train_state = _snapshot_tree(train_state, lambda t: t.detach().clone())
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        else:
            weights = _snapshot_tree(weights, lambda t: t.detach().clone())
            train_state = _snapshot_tree(train_state, lambda t: t.detach().clone())
        snap = Snapshot(
            step=step,
            batch_id=batch_id,
            loss=loss,
            weights=weights,
            train_state=train_state,
            configs=configs,
            ready=ready,
            device=device,
            started=time.perf_counter(),
        )
        with self._cond:
            self._raise_if_failed()
            self._pending = snap
            self._cond.notify_all()

    def before_update(self) -> None:
        """Order the next in-place parameter update after any in-flight snapshot copy (no host wait)."""
        snap = self._pending
        if snap is not None and snap.ready is not None:
            torch.cuda.current_stream(snap.device).wait_event(snap.ready)

    def wait(self, timeout: float | None = None) -> None:
        """Block until no save is in flight; re-raises a writer-thread failure."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None or self._error is not None, timeout)
            self._raise_if_failed()

    def close(self) -> None:
        """Finish the in-flight save (if any) and stop the writer thread."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None or self._error is not None)
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"writing a checkpoint failed: {self._error!r}") from self._error

    # -- writer thread ---------------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snap = self._pending
            try:
                self._write(snap)
            except BaseException as exc:  # noqa: BLE001 - reported to the training thread
                log.exception("checkpoint at step %d failed", snap.step)
                with self._cond:
                    self._error = exc
                    self._pending = None
                    self._cond.notify_all()
                return
            with self._cond:
                self._pending = None
                self._cond.notify_all()

    def _walk_host(self, tree: Any, copy: bool) -> Any:
        """Map every CUDA tensor of ``tree`` to its page-locked host buffer (allocated on first use,
        keyed by its path in the tree, reused by later saves); ``copy`` queues the D2H copies."""

        def walk(obj: Any, path: str) -> Any:
            if isinstance(obj, torch.Tensor):
                if not obj.is_cuda:
                    return obj
                buf = self._host.get(path)
                if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                    buf = self._host[path] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
                if copy:
                    buf.copy_(obj, non_blocking=True)
                return buf
            if isinstance(obj, dict):
                return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(walk(v, f"{path}/{i}") for i, v in enumerate(obj))
            return obj

        return walk(tree, "")

    def reserve(self, weights: dict[str, torch.Tensor], train_state: dict[str, Any]) -> None:
        """Allocate the page-locked host buffers of a future save now (call before training).

        Page-locking ~16 bytes per parameter takes seconds and, mid-run, stalls the training
        thread's kernel launches (measured on an H200: a 5 s step after the first save); done at
        start-up it costs nothing later. Pass tensors (or ``torch.empty_like`` stand-ins) with the
        same structure, shapes and dtypes as the real save; mismatched entries are reallocated.
        """
        self._walk_host((weights, train_state), copy=False)

    def _to_host(self, tree: Any, device: Any) -> Any:
        """Copy the device snapshot into the reused page-locked buffers on this writer thread's copy
        stream, then let the device clones go."""
        if self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self._d2h_stream):
            host = self._walk_host(tree, copy=True)
        self._d2h_stream.synchronize()  # the clones are dropped by the caller after this
        return host

    def _write(self, snap: Snapshot) -> None:
        if snap.ready is not None:
            snap.ready.synchronize()  # only this writer thread waits for the snapshot clone
            snap.weights, snap.train_state = self._to_host((snap.weights, snap.train_state), snap.device)
        bad = [k for k, t in snap.weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            log.error("not writing checkpoint at step %d: non-finite weights in %s", snap.step, bad[:5])
            self.on_event({"kind": "checkpoint", "step": snap.step, "path": None, "healthy": False,
                           "reason": f"non-finite weights in {bad[:5]}", "save_s": 0.0, "time": time.time()})
            return
        final = step_dir(self.root, snap.step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: t.contiguous() for k, t in snap.weights.items()}, str(tmp / "model.safetensors"))
        for name, cfg in snap.configs.items():
            _write_json(tmp / name, cfg)
        # Big tensors (optimizer moments) go to safetensors, the small rest to train_state.pt.
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _split_tensors(snap.train_state, "", tensors)
        save_file(tensors, str(tmp / "train_state.safetensors"))
        with open(tmp / "train_state.pt", "wb") as f:
            torch.save(skeleton, f)
            f.flush()
            os.fsync(f.fileno())
        save_s = time.perf_counter() - snap.started
        meta = {"step": snap.step, "batch_id": snap.batch_id, "loss": snap.loss,
                "config_hash": self.config_hash, "healthy": True, "time": time.time(), "save_s": save_s}
        _write_json(tmp / "meta.json", meta)
        _usual_mode(tmp / "model.safetensors", tmp / "train_state.safetensors")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self.last_healthy = final
        self._apply_retention()
        log.info("checkpoint step %d written to %s in %.2fs (background)", snap.step, final, save_s)
        self.on_event({"kind": "checkpoint", "step": snap.step, "path": str(final), "healthy": True,
                       "save_s": round(save_s, 4), "time": time.time()})

    def _apply_retention(self) -> None:
        complete = [p for p in list_checkpoints(self.root) if read_meta(p) is not None]
        for old in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)


_TENSOR_REF = "__safetensors__:"


def _split_tensors(obj: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested structure by a reference and collect it in ``out``."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj.contiguous()
        return _TENSOR_REF + path
    if isinstance(obj, dict):
        return {k: _split_tensors(v, f"{path}/{k}", out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, f"{path}/{i}", out) for i, v in enumerate(obj))
    return obj


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`_split_tensors`."""
    if isinstance(obj, str) and obj.startswith(_TENSOR_REF):
        return tensors[obj[len(_TENSOR_REF):]]
    if isinstance(obj, dict):
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root`` (complete or not, no ``.tmp-*``), oldest step first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(dirs, key=lambda p: p.name)


def read_meta(path: Path) -> dict[str, Any] | None:
    """``meta.json`` of a checkpoint, or None if it is missing or unreadable (an incomplete save)."""
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def is_healthy(path: Path) -> bool:
    """True if the checkpoint is complete, marked healthy, and its tensor files are readable.

    Cheap: ``meta.json`` plus the safetensors *headers* of ``model.safetensors`` and (when
    present) ``train_state.safetensors`` (``safe_open`` reads the header and checks that the file
    is as long as the header says: a truncated copy fails), no tensor data.
    """
    meta = read_meta(path)
    if not (meta and meta.get("healthy")) or not (path / "train_state.pt").is_file():
        return False
    state = path / "train_state.safetensors"
    return _readable_safetensors(path / "model.safetensors") and (
        not state.exists() or _readable_safetensors(state))


def _readable_safetensors(file: Path) -> bool:
    """The file exists and its safetensors header parses and covers the file (no data read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt"):
            return True
    except Exception:  # noqa: BLE001 - SafetensorError, OSError: not a usable file
        return False


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """Which checkpoint to resume from.

    Args:
        run_dir: the run directory (checkpoints live in ``run_dir/checkpoints``).
        resume: ``"none"`` (start fresh), ``"auto"`` (the newest *healthy* checkpoint of this run,
            or none if there is none), or a path to a checkpoint directory.

    Raises:
        CheckpointError: a given path does not exist or is not a complete, healthy checkpoint.
    """
    if resume == "none":
        return None
    if resume == "auto":
        healthy = [p for p in list_checkpoints(Path(run_dir) / "checkpoints") if is_healthy(p)]
        return healthy[-1] if healthy else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    if not is_healthy(path):
        raise CheckpointError(
            f"--resume {resume}: not a complete healthy checkpoint (meta.json missing, unhealthy, or files "
            "missing); pick another one (python -m dflash.logs RUN_DIR lists them) or use --resume auto"
        )
    return path


def load_train_state(path: Path) -> dict[str, Any]:
    """The ``train_state.pt`` of a checkpoint (optimizer, scheduler, sampler, RNG, counters)."""
    from safetensors.torch import load_file

    try:
        skeleton = torch.load(path / "train_state.pt", map_location="cpu", weights_only=False)
        big = path / "train_state.safetensors"
        tensors = load_file(str(big)) if big.is_file() else {}
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"cannot read the train state of {path}: {exc}") from exc
    return _join_tensors(skeleton, tensors)
