"""Writing the training metrics: ``metrics.jsonl`` (:class:`MetricsLog`), fixed step windows, wandb.

Failure mode 5 of docs/failure-modes.md: a monitor that averaged "whatever accumulated since I last
looked" showed phantom loss resets. Here a window is a fixed range of drafter steps ``(S - W, S]``;
each logged point carries ``step`` (its last step), ``window`` (how many steps the window spans; the
last window of a run, or the first after a resume, may be shorter and says so) and
``steps_averaged`` (how many of them the averages are over: skipped, non-finite steps are logged on
their own line and excluded, so a window of 5 holding one skip averages 4; 0 when every step was
skipped, and the averages are then null).
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from csp.observe.statslog import unwritable
from dflash.messages import StepMetrics
from dflash.records import HeldoutRecord, RecordBase, TrainRecord, encode

log = logging.getLogger("dflash.monitor")


class MetricsLog:
    """Append-only, thread-safe JSONL writer for ``RUN_DIR/metrics.jsonl``; one flushed line per
    record (the types of :mod:`dflash.records`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "ab", buffering=0)
        self.broken = False  # a write failed (full disk): later records are dropped

    def write(self, record: RecordBase | dict[str, Any]) -> None:
        """Append one record; sets its ``time`` to now when unset. A dict (``{"kind": ..., ...}``, the
        older API, still what :mod:`dflash.run.stages.trainer` may pass) is converted to its record type.

        Raises:
            dflash.records.MetricsFormatError: an unknown kind, field or value type (nothing written).
        """
        line = encode(record)
        with self._lock:
            if self._file.closed or self.broken:
                return
            try:
                self._file.write(line)
            except OSError as exc:  # a full disk: say so once, keep training (the checkpoint says the rest)
                self.broken = True
                print(f"warning: {unwritable(self.path, exc, 'its further records are dropped (said once)')}",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            try:
                self._file.close()
            except OSError:  # the buffered bytes of a write that already failed and was said
                pass


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


class WindowAggregator:
    """Collects :class:`StepMetrics` and emits one record per fixed window of ``window`` steps.

    Windows are aligned to step numbers: with ``window=10`` the points are at steps 10, 20, 30, ...
    whatever step a run resumed from (a resume from step 25 emits a 5-step window at 30 first).

    Throughput in a record:
        ``tok_s``: real tokens trained / wall seconds of the window (the pipeline's throughput).
        ``target_tok_s``: real tokens / summed target forward seconds (one replica's speed).
        ``drafter_tok_s``: real tokens / summed drafter step seconds.
        ``padding_waste``: padding tokens / computed tokens over the window (fraction).
    """

    def __init__(self, window: int, start_time: float | None = None, skipped_total: int = 0) -> None:
        """``skipped_total``: skipped steps before the first one added (a resumed run's count)."""
        self.window = window
        self._items: list[StepMetrics] = []
        self._last_time = start_time if start_time is not None else time.time()
        self.skipped_total = skipped_total

    def add(self, m: StepMetrics) -> TrainRecord | None:
        """Add one step; returns the window's record when ``m.step`` closes a window, else None."""
        self._items.append(m)
        if m.skipped:
            self.skipped_total += 1
        if m.step % self.window == 0:
            return self.flush()
        return None

    def flush(self) -> TrainRecord | None:
        """Emit the (possibly partial) open window, or None if it is empty."""
        if not self._items:
            return None
        items, self._items = self._items, []
        ok = [m for m in items if not m.skipped]
        last = items[-1]
        wall = max(last.time - self._last_time, 1e-9)
        self._last_time = last.time
        tokens = sum(m.num_tokens for m in items)
        padding = sum(m.num_padding for m in items)
        target_s = sum(m.target_s for m in items)
        step_s = sum(m.step_s for m in items)
        acc = [_mean([m.acc_per_pos[j] for m in ok]) for j in range(len(ok[0].acc_per_pos))] if ok else []
        return TrainRecord(
            **_selector_fields(items, ok),
            **_term_fields(items, ok),
            step=last.step,
            window=len(items),
            steps_averaged=len(ok),
            loss=_mean([m.loss for m in ok]),
            ce=_mean([m.ce for m in ok]),
            kl=_mean([m.kl for m in ok]),
            acc=[round(a, 5) for a in acc],
            tau_sim=_mean([m.accepted_sim + 1.0 for m in ok]),
            accepted_sim=_mean([m.accepted_sim for m in ok]),
            lr=last.lr,
            grad_norm=_mean([m.grad_norm for m in ok]),
            tok_s=tokens / wall,
            target_tok_s=tokens / target_s if target_s > 0 else float("nan"),
            drafter_tok_s=tokens / step_s if step_s > 0 else float("nan"),
            padding_waste=padding / max(tokens + padding, 1),
            blocks=sum(m.num_blocks for m in items),
            skipped_total=self.skipped_total,
            time=last.time,
        )


def _term_fields(items: list[StepMetrics], ok: list[StepMetrics]) -> dict[str, float]:
    """The TV and confidence loss terms' window means (each left out when no step of the window
    computed it: its ``[loss]`` weight is 0)."""
    return {k: _mean([getattr(m, k) for m in ok if getattr(m, k) is not None])
            for k in ("tv", "conf") if any(getattr(m, k) is not None for m in items)}


def _selector_fields(items: list[StepMetrics], ok: list[StepMetrics]) -> dict[str, Any]:
    """DFlash2's window fields (none for a DFlash run): means over the trained steps, the
    missing-label count summed over the window."""
    sel = [m for m in ok if m.sel_acc_per_pos is not None]
    if not any(m.sel_acc_per_pos is not None for m in items):
        return {}
    acc = [_mean([m.sel_acc_per_pos[j] for m in sel]) for j in range(len(sel[0].sel_acc_per_pos))] if sel else []
    return {
        "sel_loss": _mean([m.sel_loss for m in sel]),
        "sel_acc": [round(a, 5) for a in acc],
        "sel_tau": _mean([m.sel_accepted + 1.0 for m in sel]),
        "base_tau": _mean([m.base_accepted + 1.0 for m in sel]),
        "recall_k": _mean([m.recall_k for m in sel]),
        "oracle_tau": _mean([m.oracle_accepted + 1.0 for m in sel]),
        "label_missing": sum(m.label_missing or 0 for m in items),
    }


WANDB_ID = Path("wandb") / "run-id"
"""Where a run directory keeps its wandb run id (relative to the run directory)."""


class WandbSink:
    """Logs window records to wandb (offline by default: files under RUN_DIR/wandb, no network).

    ``mode="online"`` needs ``wandb login``; ``"disabled"`` turns it off. The wandb step is the
    drafter step, so curves line up with ``metrics.jsonl``. One run directory is one wandb run:
    its id is kept in ``RUN_DIR/wandb/run-id`` and every resume logs into it (``resume="allow"``),
    so ``wandb sync`` of all its offline segments, or an online run, shows one continuous curve.
    """

    def __init__(self, mode: str, project: str, name: str, run_dir: Path, config: dict[str, Any]) -> None:
        self.run = None
        if mode == "disabled":
            return
        home = Path(run_dir) / WANDB_ID.parent
        if home.exists() and not home.is_dir():  # wandb.init cannot write there: the run goes on without it
            log.warning("%s is a file, not a directory: wandb logs nothing in this run (metrics.jsonl has every "
                        "window); move that file away to log to wandb again", home)
            return
        import wandb

        # offline (the default): no history sparklines or sync hints from wandb at the end, which would
        # push the run summary (whose "next" block gives the sync command) off the screen
        quiet = {"settings": wandb.Settings(quiet=True)} if mode == "offline" else {}
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config,
                              id=run_id(run_dir), resume="allow", reinit="create_new", **quiet)
        # held-out results arrive after later windows were logged: charted against their own step
        self.run.define_metric("heldout/step")
        self.run.define_metric("heldout/*", step_metric="heldout/step")
        self.last_step = 0

    def log(self, record: TrainRecord) -> None:
        if self.run is None:
            return
        data = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        for j, a in enumerate(record.get("acc") or [], start=1):
            data[f"acc/pos{j}"] = a
        for j, a in enumerate(record.get("sel_acc") or [], start=1):
            data[f"sel_acc/pos{j}"] = a
        data = {k: v for k, v in data.items() if not (isinstance(v, float) and math.isnan(v))}
        self.last_step = max(self.last_step, record.step)
        self.run.log(data, step=record.step)

    def log_heldout(self, record: HeldoutRecord) -> None:
        """An in-training evaluation as ``heldout/tau``, ``heldout/accepted``, ``heldout/sampled_tau``,
        ``heldout/fresh_tau``, ``heldout/loop_share`` (where measured),
        charted against ``heldout/step`` (the snapshot's step): wandb's own step only moves forward,
        and an evaluation finishes after later windows were logged."""
        if self.run is None:
            return
        data = {f"heldout/{k}": record.get(k) for k in ("step", "tau", "accepted", "sampled_tau", "tree_tau",
                                                         "fresh_tau", "loop_share", "seconds")}
        self.run.log({k: v for k, v in data.items() if isinstance(v, (int, float)) and not math.isnan(v)},
                     step=self.last_step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A run id this module keeps: wandb's own are 8 lowercase letters and digits; wandb refuses some
characters (``:;,#?/'``) and puts the id in directory names, so a longer or odder one is not used."""


def run_id(run_dir: Path, new: Callable[[], str] = lambda: uuid.uuid4().hex[:8]) -> str:
    """The wandb run id of ``run_dir``: the one kept in :data:`WANDB_ID`, or a ``new()`` one
    (8 lowercase hex characters, the shape of wandb's own ids), kept there for the next segment.

    A kept id that cannot be used (unreadable, not UTF-8, empty, too long, characters wandb refuses)
    and a file that cannot be written cost only the continuity of the curve, never the run: one
    warning line names the file, and this segment logs to a new id."""
    path = Path(run_dir) / WANDB_ID
    kept, why = _kept_id(path)
    if kept is not None:
        return kept
    fresh = new()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fresh + "\n", encoding="utf-8")
        keeps = "the file now keeps the new id"
    except OSError as exc:
        keeps = f"it cannot keep the new one ({exc.strerror or exc}): the next segment starts apart again"
    if why is not None:
        log.warning("%s %s: wandb logs this segment as a new run %s, its curve apart from the earlier segments'; "
                    "%s", path, why, fresh, keeps)
    elif not keeps.startswith("the file"):
        log.warning("%s: %s", path, keeps)
    return fresh


def _kept_id(path: Path) -> tuple[str | None, str | None]:
    """``(id, None)`` for a usable kept id, ``(None, why not)`` for an unusable one, ``(None, None)``
    when there is none yet."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1024)  # an id is short: the rest of a huge file is never read
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    if not text:
        return None, "is empty"
    if not _ID.fullmatch(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        return None, f"holds {shown!r}, not a run id (1 to 64 letters, digits, '-' or '_')"
    return text, None
