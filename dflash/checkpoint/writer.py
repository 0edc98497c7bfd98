"""Atomic, non-stalling checkpoint writes of the drafter's training state, retention and health.

The layout written is :mod:`dflash.checkpoint.format`'s (``meta.json`` is its :class:`Meta`).

How a save avoids stalling the pipeline (failure mode 4 of docs/failure-modes.md): the training thread only
*snapshots* the state — on CUDA a device-to-device clone on a side stream, ordered after the
optimizer step by an event; on CPU a clone — and a background writer thread does the slow part
(host copy, non-finite check, serialisation, fsync, rename). The trainer calls :meth:`Checkpointer.before_update`
before the next optimizer step so that step cannot overwrite parameters the copy still reads.

Atomicity: files go to ``.tmp-step_N`` and the directory is renamed to ``step_N`` only after
``meta.json`` (written last) is fsynced. A crash or Ctrl-C mid-save leaves a ``.tmp-*`` directory that
resume ignores and the next save removes. A snapshot with non-finite weights or optimizer state
is never written.

Health (``meta.json["healthy"]``, decided when the checkpoint is written): a checkpoint is healthy
when its step was trained (not skipped: no non-finite streak is running when it is saved) and the
loss of its own window — the mean over the steps trained since the previous checkpoint, skipped
steps excluded — is finite. Otherwise it is written with ``healthy: false`` and a ``reason``, and
``resume = "auto"`` passes over it. A run that stops on a non-finite streak which began right after
a healthy checkpoint marks that checkpoint unhealthy too (:func:`mark_unhealthy`): its weights are
what every later step failed on. :mod:`dflash.checkpoint.resume` verifies the tensors themselves before a
resume.

A full disk (``ENOSPC`` while a checkpoint is written): the partial ``.tmp-step_N`` is removed at
once, the previous checkpoints stay as they were, the writer logs one line (no traceback) and the
training thread gets a :class:`dflash.errors.DiskFullError` naming the device and the last good
checkpoint at its next save or wait (``python -m dflash.run`` then stops with exit code 4).

Lineage: every checkpoint records the ``lineage`` id of the run that wrote it (a fresh start makes a
new id, a resume keeps the checkpoint's). Retention only ever deletes checkpoints of its own lineage.
"""


from __future__ import annotations

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

from csp.cuda.tensors import map_tensors
from dflash.checkpoint.files import device_of, fsync_dir, usual_mode, write_json
from dflash.checkpoint.format import (
    META,
    TMP_PREFIX,
    TRAIN_STATE,
    TRAIN_TENSORS,
    WEIGHTS,
    CheckpointError,
    Meta,
    _split_tensors,
    is_healthy,
    list_checkpoints,
    nonfinite_tensors,
    read_meta,
    slash_path,
    step_dir,
)
from dflash.checkpoint.snapshot import Snapshot, health_reason, is_disk_full, snapshot_tree
from dflash.errors import DiskFullError
from dflash.records import CheckpointRecord

log = logging.getLogger("dflash.checkpoint")


class Checkpointer:
    """Writes checkpoints in a background thread, keeps the last ``keep_last`` healthy ones.

    Args:
        root: the ``checkpoints`` directory of the run.
        keep_last: how many complete healthy checkpoints of this lineage to keep (older ones are
            deleted after a newer one is written; see :meth:`_apply_retention`).
        config_hash: hash of the resolved graph file, stored in ``meta.json``.
        on_event: called from the writer thread with a :class:`dflash.records.CheckpointRecord`
            for ``metrics.jsonl`` after each save attempt.
        lineage: id of the run's lineage, stored in ``meta.json``; retention never deletes a
            checkpoint of another lineage (or of none).
        protect: asked at each retention: a step whose healthy checkpoint is kept beside the newest
            ``keep_last`` (the best held-out step, ``[checkpoint].keep_best``), or None.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep_last: int,
        config_hash: str,
        on_event: Callable[[CheckpointRecord], None] | None = None,
        lineage: str | None = None,
        protect: Callable[[], int | None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.protect = protect or (lambda: None)
        self.lineage = lineage
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-save
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.on_event = on_event or (lambda event: None)
        self._pending: Snapshot | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._reported = False
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
        window_steps: int = 0,
        window_skipped: int = 0,
        last_skipped: bool = False,
        skipped_total: int = 0,
    ) -> None:
        """Snapshot the state and hand it to the writer thread; returns without waiting for disk.

        Args:
            step, batch_id: the step just trained and the batch it trained on.
            loss: mean loss of the checkpoint's window (the steps since the previous checkpoint,
                skipped ones excluded); nan when every one was skipped.
            window_steps, window_skipped: steps in that window, and how many were skipped.
            last_skipped: True when ``step`` itself was skipped (a non-finite streak is running).
            skipped_total: skipped steps of the whole run so far.
            weights, train_state, configs: what the files hold (``configs``: file name -> object).

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
                weights = snapshot_tree(weights, lambda t: t.detach().clone())
                train_state = snapshot_tree(train_state, lambda t: t.detach().clone())
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        else:
            weights = snapshot_tree(weights, lambda t: t.detach().clone())
            train_state = snapshot_tree(train_state, lambda t: t.detach().clone())
        snap = Snapshot(
            step=step,
            batch_id=batch_id,
            loss=loss,
            window_steps=window_steps,
            window_skipped=window_skipped,
            last_skipped=last_skipped,
            skipped_total=skipped_total,
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
        if self._error is None or self._reported:
            return
        self._reported = True  # once: teardown's close() after the stop does not raise it again
        if isinstance(self._error, DiskFullError):
            raise DiskFullError(str(self._error)) from None
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
                if isinstance(exc, DiskFullError):
                    log.error("%s", exc)  # one line: the cause is known, a traceback adds nothing
                else:
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

        def host(p: tuple, obj: torch.Tensor) -> torch.Tensor:
            if not obj.is_cuda:
                return obj
            path = slash_path(p)
            buf = self._host.get(path)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self._host[path] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
            if copy:
                buf.copy_(obj, non_blocking=True)
            return buf

        return map_tensors(host, tree, paths=True)

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
        bad_state = nonfinite_tensors(snap.train_state)
        if bad or bad_state:
            what = f"non-finite weights in {bad[:5]}" if bad else f"non-finite train state in {bad_state[:5]}"
            log.error("not writing checkpoint at step %d: %s", snap.step, what)
            self.on_event(CheckpointRecord(step=snap.step, path=None, healthy=False, reason=what, save_s=0.0,
                                           time=time.time()))
            return
        reason = health_reason(snap)
        final = step_dir(self.root, snap.step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_s = self._write_files(snap, tmp, reason)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save only takes space
            if is_disk_full(exc):
                last = self.last_healthy or next(
                    (p for p in reversed(list_checkpoints(self.root)) if is_healthy(p)), None)
                raise DiskFullError(
                    f"no space left on device: {device_of(self.root)} is full; checkpoint step {snap.step} "
                    f"was not written (its partial {tmp.name} removed); last good checkpoint: "
                    f"{last or 'none'}; free space, then resume with --resume auto") from None
            raise
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        if reason is None:
            self.last_healthy = final
            log.info("checkpoint step %d written to %s in %.2fs (background)", snap.step, final, save_s)
        else:
            log.warning("checkpoint step %d written to %s but marked UNHEALTHY (%s); resume = \"auto\" "
                        "will not pick it", snap.step, final, reason)
        self._apply_retention()
        self.on_event(CheckpointRecord(step=snap.step, path=str(final), healthy=reason is None,
                                       reason=reason or msgspec.UNSET, save_s=round(save_s, 4), time=time.time()))

    def _write_files(self, snap: Snapshot, tmp: Path, reason: str | None) -> float:
        """Every file of the checkpoint into ``tmp`` (created), fsynced; returns the save time (s).
        Raises OSError (a full disk: ``ENOSPC``)."""
        tmp.mkdir(parents=True)
        save_file({k: t.contiguous() for k, t in snap.weights.items()}, str(tmp / WEIGHTS))
        for name, cfg in snap.configs.items():
            write_json(tmp / name, cfg)
        # Big tensors (optimizer moments) go to safetensors, the small rest to train_state.pt.
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _split_tensors(snap.train_state, "", tensors)
        save_file(tensors, str(tmp / TRAIN_TENSORS))
        with open(tmp / TRAIN_STATE, "wb") as f:
            torch.save(skeleton, f)
            f.flush()
            os.fsync(f.fileno())
        save_s = time.perf_counter() - snap.started
        meta = Meta(step=snap.step, batch_id=snap.batch_id, loss=snap.loss, window_steps=snap.window_steps,
                    window_skipped=snap.window_skipped, skipped_total=snap.skipped_total,
                    healthy=reason is None, reason=reason, lineage=self.lineage,
                    config_hash=self.config_hash, time=time.time(), save_s=save_s)
        write_json(tmp / META, meta)
        usual_mode(tmp / WEIGHTS, tmp / TRAIN_TENSORS)
        fsync_dir(tmp)
        return save_s

    def _apply_retention(self) -> None:
        """Keep the newest ``keep_last`` healthy checkpoints of this lineage, the healthy one at the
        step ``protect()`` names and, of its unhealthy ones, at most ``keep_last`` newer than the
        newest healthy one (for a post-mortem); delete the rest of this lineage. Checkpoints of
        another lineage are never touched."""
        ours = [(p, m) for p in list_checkpoints(self.root)
                if (m := read_meta(p)) is not None and m.get("lineage") == self.lineage]
        healthy = [p for p, m in ours if m.get("healthy")]
        newest = healthy[-1].name if healthy else ""
        unhealthy = [p for p, m in ours if not m.get("healthy") and p.name > newest]
        best = self.protect()
        keep = set(healthy[-self.keep_last:]) | set(unhealthy[-self.keep_last:])
        keep |= {p for p, m in ours if best is not None and m.get("healthy") and m.get("step") == best}
        for old, _ in ours:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)
