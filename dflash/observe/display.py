"""The live training display: throughput, loss, accepted length, progress with ETA, channel fills.

The monitor stage calls :meth:`TrainingDisplay.update` once per logged window with the ``train``
record it wrote to ``metrics.jsonl`` (keys as in ``docs/architecture.md``: ``step``, ``loss``,
``tau_sim`` (tokens per verify step), ``accepted_sim``, ``target_tok_s``, ``drafter_tok_s``, ``lr``, ``skipped_total``, ``time``) and the
current :class:`csp.core.stats.ChannelStatistics` of the graph's channels.

* On a terminal it is a rich ``Live`` view repainted by rich's own thread at ``refresh_per_second``
  (default 4 Hz). ``update`` only swaps the renderable (no repaint, no I/O), so it costs
  microseconds and never waits on the terminal: the display cannot stall training.
* When the output is not a terminal (a log file, a pipe, CI) one :data:`LEGEND` line says what the
  figures are, then each update prints one plain line,
  the same line :func:`format_line` returns (``run.log`` gets it too, through the
  ``dflash.observe.display`` logger, see :mod:`dflash.observe.runlog`)::

      step 120/1000 12.0% | loss 2.346 tau 3.21 (accepted 2.21) | target 29.8K tok/s drafter 51.2K tok/s | lr 3.0e-04 | eta 1:23:45 | batches 3/8 features 1/4

ETA = remaining steps / recent rate, the rate being measured over the last ``rate_window`` updates
(from the records' ``time``; the display's clock when a record has none), so it follows the
current speed rather than the average since start (which a resume or a stall would skew).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dflash.observe import runlog

_window_log = logging.getLogger("dflash.display")

MODES = ("auto", "live", "plain", "off")


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def _si(x: Any) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else str(x)


def _eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _selector_line(record: Mapping[str, Any]) -> str:
    """DFlash2's window figures: teacher-forced tau of the walk and of the backbone's top-1, the
    oracle top-K tau and recall@K (dflash.train.selector_loss); XPress's: the tau of its Jacobi
    drafts and of the backbone's top-1 (dflash.train.xpress_loss; it has no top-K)."""
    recall = record.get("recall_k")
    if not (isinstance(recall, (int, float)) and math.isfinite(recall)):
        return f"jacobi tau {_num(record.get('sel_tau'), '.3g')} (top-1 {_num(record.get('base_tau'), '.3g')})"
    return (f"walk tau {_num(record.get('sel_tau'), '.3g')} (top-1 {_num(record.get('base_tau'), '.3g')}, "
            f"oracle {_num(record.get('oracle_tau'), '.3g')}, recall@K {_num(record.get('recall_k'), '.3g')})")


def _partly_averaged(record: Mapping[str, Any]) -> bool:
    """True when the window's averages leave out some of its steps (skipped ones)."""
    averaged, window = record.get("steps_averaged"), record.get("window")
    return isinstance(averaged, int) and isinstance(window, int) and averaged != window


LEGEND = ("progress lines: tau (accepted) = tokens per verify step simulated from the window's per-position "
          "accuracy on training batches (the held-out tau, measured by decoding, has lines of its own); "
          "NAME n/c = items waiting in that channel / its capacity (a full channel: the stage reading it is "
          "the slower one; python -m csp.inspect RUN_DIR after the run)")
"""Printed once, before the first plain line: what the line's figures are (the live view labels its own)."""


def format_line(record: Mapping[str, Any], channels: Iterable[Any] = (), *,
                total_steps: int | None = None, eta_s: float | None = None) -> str:
    """One plain log line for a train record (see the module docstring for an example).

    ``channels`` holds ChannelStatistics (or dicts with ``name``, ``current_fill``, ``capacity``).
    A record flagged ``"spike": true`` by the monitor gets a ``SPIKE`` mark after the loss; one whose
    ``steps_averaged`` is less than its ``window`` (skipped steps) says ``averaged N/W steps``.
    """
    step = record.get("step", 0)
    progress = f"step {step}"
    if total_steps:
        progress += f"/{total_steps} {100 * step / total_steps:.1f}%"
    parts = [progress,
             f"loss {_num(record.get('loss'), '.4g')}{' SPIKE' if record.get('spike') else ''} "
             f"tau {_num(record.get('tau_sim'), '.3g')} (accepted {_num(record.get('accepted_sim'), '.3g')})",
             f"target {_si(record.get('target_tok_s'))} tok/s drafter "
             f"{_si(record.get('drafter_tok_s'))} tok/s",
             f"lr {_num(record.get('lr'), '.1e')}"]
    if "sel_tau" in record:  # DFlash2: the selector walk's figures beside the backbone's
        parts.insert(2, _selector_line(record))
    if record.get("skipped_total"):
        parts.append(f"skipped {record['skipped_total']}")
    if _partly_averaged(record):
        parts.append(f"averaged {record['steps_averaged']}/{record['window']} steps")
    if total_steps:
        parts.append(f"eta {_eta(eta_s)}")
    fills = " ".join(f"{_get(c, 'name')} {_get(c, 'current_fill')}/{_get(c, 'capacity')}"
                     for c in channels)
    if fills:
        parts.append(fills)
    return " | ".join(parts)


class TrainingDisplay:
    """Shows training progress live on a terminal, or as one plain line per window elsewhere.

    Args:
        total_steps: steps the run will make (for the progress bar and ETA); None if unknown.
        mode: "auto" (a rich Live view iff ``file`` is a terminal, else plain lines), "live",
            "plain", or "off" (nothing printed; ``log_file`` still gets the lines).
        file: where to write (default: the run's console, :func:`dflash.observe.runlog.console`, on
            stderr, the console the log lines use, so they show above the live view).
        refresh_per_second: repaint rate of the Live view (Hz).
        log_file: an open text file that also receives every plain line (e.g. run.log), or None.
        rate_window: updates over which the step rate (for the ETA) is measured.
        clock: seconds; used for the rate when a record carries no ``time`` (injectable for tests).
        title: shown in the live view (the run name).
        start_step: the step the run resumed from (0 for a fresh run), shown in the live view.

    Raises: ValueError on an unknown ``mode``.

    Use as a context manager, or call :meth:`close` on every path (it stops the refresh thread).
    """

    def __init__(self, total_steps: int | None = None, *, mode: str = "auto",
                 file: TextIO | None = None, refresh_per_second: float = 4.0,
                 log_file: TextIO | None = None, rate_window: int = 20,
                 clock: Callable[[], float] = time.monotonic, title: str = "dflash",
                 start_step: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"display mode {mode!r}: use one of {', '.join(MODES)} "
                             "([monitor].display in the graph file)")
        self.total_steps = total_steps
        self.title = title
        self.start_step = start_step
        self.mode = mode
        self.console = Console(file=file) if file is not None else runlog.console()
        self.log_file = log_file
        self._clock = clock
        self._points: deque[tuple[float, int]] = deque(maxlen=max(rate_window, 2))
        self._live: Live | None = None
        if mode == "live" or (mode == "auto" and self.console.is_terminal):
            self._live = Live(Text(f"{title}: waiting for the first window"), console=self.console,
                              refresh_per_second=refresh_per_second, transient=False)
            self._live.start()
        self.last_line = ""
        self._legend_shown = False

    @property
    def is_live(self) -> bool:
        """True when the rich Live view is in use (a terminal), False for plain lines."""
        return self._live is not None

    def eta_s(self) -> float | None:
        """Seconds to ``total_steps`` at the recent step rate; None if unknown."""
        if not self.total_steps or len(self._points) < 2:
            return None
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return max(self.total_steps - s1, 0) * (t1 - t0) / (s1 - s0)

    def update(self, record: Mapping[str, Any], channels: Iterable[Any] = ()) -> str:
        """Show one logged window. Returns the plain line (also written when not live). Never blocks
        on the terminal: in live mode it only replaces what rich's refresh thread paints next."""
        channels = list(channels.values() if isinstance(channels, Mapping) else channels)
        t = record.get("time")
        step = record.get("step", 0)
        self._points.append((t if isinstance(t, (int, float)) and math.isfinite(t) else self._clock(), step))
        eta = self.eta_s()
        line = format_line(record, channels, total_steps=self.total_steps, eta_s=eta)
        self.last_line = line
        if not self._legend_shown and self._live is None:
            self._legend_shown = True
            self.note(LEGEND)
        _window_log.info(line, extra=runlog.FILE_ONLY)  # run.log (the terminal shows it below)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()
        if self._live is not None:
            self._live.update(self._renderable(record, channels, eta), refresh=False)
        elif self.mode != "off":
            self.console.file.write(line + "\n")
            self.console.file.flush()
        return line

    def note(self, text: str) -> None:
        """An event line (checkpoint saved, step skipped, resume): printed above the live view."""
        _window_log.info(text, extra=runlog.FILE_ONLY)
        if self.log_file is not None:
            self.log_file.write(text + "\n")
            self.log_file.flush()
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        elif self.mode != "off":
            self.console.file.write(text + "\n")
            self.console.file.flush()

    def _renderable(self, record: Mapping[str, Any], channels: list[Any], eta: float | None) -> Group:
        step = record.get("step", 0)
        stats = Table.grid(padding=(0, 2))
        stats.add_row(
            Text(self.title, style="bold"),
            f"loss {_num(record.get('loss'), '.4g')}",
            f"tau {_num(record.get('tau_sim'), '.3g')} tokens/step "
            f"(accepted {_num(record.get('accepted_sim'), '.3g')})",
            f"lr {_num(record.get('lr'), '.1e')}",
            f"skipped {record.get('skipped_total', 0)}",
        )
        if "sel_tau" in record:
            stats.add_row("selector", _selector_line(record), "", "", "")
        if self.start_step:
            stats.add_row("resumed", f"from step {self.start_step}", "", "", "")
        if _partly_averaged(record):
            stats.add_row("window", f"averaged {record['steps_averaged']} of {record['window']} steps", "", "", "")
        stats.add_row("throughput", f"target {_si(record.get('target_tok_s'))} tok/s",
                      f"drafter {_si(record.get('drafter_tok_s'))} tok/s", "", "")
        progress = Table.grid(padding=(0, 2))
        if self.total_steps:
            progress.add_row(ProgressBar(total=self.total_steps, completed=min(step, self.total_steps),
                                         width=40),
                             f"step {step}/{self.total_steps}", f"eta {_eta(eta)}")
        else:
            progress.add_row(f"step {step}")
        fills = Table(title="channel fill", title_justify="left", show_edge=False, box=None)
        for col in ("channel", "", "fill"):
            fills.add_column(col)
        for c in channels:
            cap, fill = _get(c, "capacity", 0), _get(c, "current_fill", 0)
            fills.add_row(str(_get(c, "name")), ProgressBar(total=max(cap, 1), completed=min(fill, max(cap, 1)),
                                                            width=20), f"{fill}/{cap}")
        return Group(stats, progress, *([fills] if channels else []))

    def close(self) -> None:
        """Stop the Live view (idempotent); the last frame stays on screen."""
        if self._live is not None:
            refresher = getattr(self._live, "_refresh_thread", None)  # rich sets it, never joins it
            self._live.stop()
            self._live = None
            if refresher is not None:
                refresher.join(timeout=2.0)

    def __enter__(self) -> "TrainingDisplay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_display(mode: str = "auto", total_steps: int | None = None, start_step: int = 0,
                 run_name: str = "dflash", file: TextIO | None = None,
                 log_file: TextIO | None = None) -> TrainingDisplay:
    """The display the monitor stage uses (``[monitor].display`` = auto | live | plain | off)."""
    return TrainingDisplay(total_steps, mode=mode, file=file, log_file=log_file, title=run_name,
                           start_step=start_step)


__all__ = ["MODES", "TrainingDisplay", "format_line", "make_display"]
