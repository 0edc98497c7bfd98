"""Where ``dflash.run`` output goes: one console for the terminal, ``RUN_DIR/run.log`` for the record.

* **The terminal** (stderr) gets log lines, the data table, the live training view and the closing
  summary, all through one rich :class:`~rich.console.Console` (:func:`console`). Sharing it is what
  keeps log lines (a graceful-stop notice, "checkpoint written") visible above the live view: rich
  prints them above a ``Live`` only when both use the same console.
* **Piped or redirected output** (CI, ``| tee``, nohup) is plain text: one unwrapped line per log
  record (no 80-column wrapping, no ``…`` cutting a path), no colour, no repainting, no box
  drawing (the data table is aligned lines), and no tqdm bars from transformers ("Loading
  weights", repainted with carriage returns, which a log file keeps as one long line):
  :func:`quiet_progress_bars_when_piped`.
* **run.log** holds the whole story, one unwrapped timestamped line per record: the data summary,
  every window line, checkpoints, skips, resume and stop messages, the closing summary. Records
  the terminal already shows in another form (the window lines of the display, the data table)
  are logged with ``extra=FILE_ONLY`` and skipped by the terminal handler; the long stacks of
  stuck threads (logger ``csp.runtime.stack``) go to run.log only.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from csp.observe.statslog import unwritable

FILE_ONLY = {"file_only": True}  # logging ``extra=``: run.log only, not the terminal
PIPE_WIDTH = 10_000  # columns of a non-terminal console: rich never wraps or cuts at 80
_FILE_ONLY_LOGGERS = ("csp.runtime.stack",)
_MARK = "_dflash_runlog"

_console: Console | None = None


def make_console(file: Any = None) -> Console:
    """A console on ``file`` (default: stderr) that never wraps or truncates when not a terminal."""
    probe = Console(file=file, stderr=file is None)
    if probe.is_terminal:
        return probe
    return Console(file=file, stderr=file is None, width=PIPE_WIDTH, soft_wrap=True,
                   no_color=True, highlight=False)


def quiet_progress_bars_when_piped(stream: Any = None) -> bool:
    """Turn off transformers' (and huggingface_hub's) progress bars when ``stream`` (default:
    stderr) is not a terminal, through transformers' own switch
    (``transformers.utils.logging.disable_progress_bar``). A terminal keeps them. Returns True
    when they were turned off. Never raises (transformers missing: nothing to turn off)."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty():
            return False
        from transformers.utils import logging as hf_logging
    except (AttributeError, ValueError, ImportError):  # a closed or odd stream; no transformers
        return False
    hf_logging.disable_progress_bar()
    return True


def console() -> Console:
    """The console of the current run (created by :func:`setup`, or on first use)."""
    global _console
    if _console is None:
        _console = make_console()
    return _console


class _TerminalFormatter(logging.Formatter):
    """The terminal's format, without the traceback of a :class:`dflash.errors.DFlashError` (a full
    disk, the evaluator's process gone, data found unusable at run time): its one line says all
    and follows as the run's error line; run.log keeps the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        from dflash.errors import DFlashError

        if not (record.exc_info and isinstance(record.exc_info[1], DFlashError)):
            return super().format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = saved


class _TerminalFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False) and not record.name.startswith(_FILE_ONLY_LOGGERS)


def _say_once(what: Path, exc: BaseException | None) -> None:
    """The one stderr line for a run file that can no longer be written."""
    print(f"warning: {unwritable(what, exc, 'its further lines are dropped (said once)')}",
          file=sys.stderr, flush=True)


class RunLogHandler(logging.FileHandler):
    """``RUN_DIR/run.log``: a record that cannot be written (a full disk, a read-only remount) is
    reported once on stderr, and the handler stops writing, instead of logging's "--- Logging error
    ---" traceback on every later record."""

    broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            super().flush()
        except OSError as exc:
            self._give_up(exc)

    def handleError(self, record: logging.LogRecord) -> None:  # logging's name
        self._give_up(sys.exc_info()[1])

    def _give_up(self, exc: BaseException | None) -> None:
        if not self.broken:
            self.broken = True
            _say_once(Path(self.baseFilename), exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # flushing a full disk on close
            pass


def setup(run_dir: Path) -> Console:
    """Log INFO and above to the terminal and to ``RUN_DIR/run.log`` (appended); returns the console.

    A terminal gets rich log lines; anything else gets plain ``HH:MM:SS LEVEL message`` lines.
    """
    global _console
    close()
    run_dir.mkdir(parents=True, exist_ok=True)
    _console = make_console()
    quiet_progress_bars_when_piped()
    if _console.is_terminal:
        from rich.logging import RichHandler

        term: logging.Handler = RichHandler(console=_console, show_path=False, rich_tracebacks=False,
                                            markup=False)
        term.setFormatter(_TerminalFormatter("%(message)s"))
    else:
        term = logging.StreamHandler(sys.stderr)
        term.setFormatter(_TerminalFormatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    term.addFilter(_TerminalFilter())
    term.setLevel(logging.INFO)
    file = RunLogHandler(run_dir / "run.log")
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in (term, file):
        setattr(h, _MARK, True)
        root.addHandler(h)
    root.setLevel(logging.INFO)
    return _console


def close() -> None:
    """Remove and close the handlers :func:`setup` added (idempotent)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _MARK, False):
            root.removeHandler(h)
            h.close()


def file_handlers() -> list[logging.FileHandler]:
    """The run.log handlers :func:`setup` installed (empty outside a run)."""
    return [h for h in logging.getLogger().handlers
            if getattr(h, _MARK, False) and isinstance(h, logging.FileHandler)]


def data_line(summary: Any) -> str:
    """The data summary (a :class:`dflash.data.DataSummary`) as one line for run.log."""
    from dflash.data.dataset import stopped_text, truncation_text

    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(summary.skipped.items())) or "none"
    how = "cache hit" if summary.from_cache else f"tokenized in {summary.seconds:.1f} s"
    return (f"data: {summary.source} ({how}): {summary.records_read:,} records read{stopped_text(summary)}, "
            f"{summary.conversations:,} conversations kept, {summary.num_tokens:,} tokens "
            f"({summary.num_loss_tokens:,} with loss), truncated to max_length: {truncation_text(summary)}; "
            f"skipped: {skipped}; cache {summary.cache_path}")


__all__ = ["FILE_ONLY", "PIPE_WIDTH", "close", "console", "data_line", "file_handlers", "make_console",
           "quiet_progress_bars_when_piped", "setup"]
