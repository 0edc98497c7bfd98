"""``python -m csp.inspect RUN_DIR``: where is the backpressure, and which stage is the bottleneck?

Reads ``RUN_DIR/csp/stats.jsonl`` (or a stats file given directly) and prints, per channel, its fill
(now, average, peak against capacity), how much of the time its senders were blocked and its
receivers waited, and its items/s and bytes/s; per process replica and per process name, the
fraction of alive time spent busy, waiting for input and blocked on output; a one-line verdict
starting with ``bottleneck:`` (``deadlock:`` for a run stopped as deadlocked); and what-if lines:
the items/s predicted with one more replica of the slowest stages, and where the bottleneck moves
(:mod:`csp.observe.whatif`). How each number is normalised, and the bottleneck rule, are in
:mod:`csp.observe.backpressure`.

Usage::

    python -m csp.inspect RUN_DIR                 # a finished (or crashed) run: the whole log
    python -m csp.inspect RUN_DIR --window 30     # only the last 30 s of the log
    python -m csp.inspect RUN_DIR --follow        # a live run: refresh until the final record
    python -m csp.inspect RUN_DIR --json          # one JSON object (JSON lines with --follow)

On a terminal the report is a rich table (a rich Live view with ``--follow``); when stdout is not a
terminal it is plain text, and ``--follow`` prints one verdict line per refresh, then the report.
Exit status: 0, or 2 when the stats log is missing or malformed, the file given is not a stats log
(a graph file, a trace), or an option is bad (e.g. ``--window 0``). Rates are human-readable (``37K`` items/s, ``1.2 GB/s``, :mod:`csp.observe.units`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, TextIO

import msgspec
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from csp.cli import make_parser, positive_float
from csp.observe.backpressure import (
    ChannelSummary,
    StatsFormatError,
    StatsReader,
    Summary,
    read_stats,
    stats_path,
    summarize,
)
from csp.observe.units import bytes_rate, count
from csp.observe.whatif import fit, what_if_lines


def _bytes(c: ChannelSummary) -> str:
    # csp counts tensor bytes only (csp.item_nbytes): items without tensors carry "-", not "0 B/s"
    return "-" if c.bytes_per_s == 0 and c.items_per_s > 0 else bytes_rate(c.bytes_per_s)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _header_line(summary: Summary, source: str) -> str:
    status = "live (no final record)" if summary.status is None else summary.status
    if summary.exit_code is not None:
        status += f" (exit {summary.exit_code})"
    return (f"{source}: {status}; window {summary.t_start:.1f}-{summary.t_end:.1f} s "
            f"({summary.samples} samples)")


def _channel_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    head = ["channel", "capacity", "fill now", "fill avg", "fill peak", "send blocked",
            "recv waiting", "items/s", "bytes/s"]
    rows = [[c.name, str(c.capacity), str(c.fill_now), f"{c.fill_avg:.1f}", str(c.fill_peak),
             _pct(c.send_blocked_frac), _pct(c.receive_wait_frac), count(c.items_per_s),
             _bytes(c)] for c in summary.channels]
    return head, rows


def _process_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    head = ["process", "state", "busy", "waiting input", "blocked output", "items in/s", "items out/s"]
    rows = []
    for p in summary.processes:
        states = sorted({r.state for r in p.replicas})
        label = p.name if len(p.replicas) == 1 else f"{p.name} (all {len(p.replicas)})"
        rows.append([label, ",".join(states), _pct(p.busy_frac), _pct(p.wait_input_frac),
                     _pct(p.blocked_output_frac), count(p.items_in_per_s), count(p.items_out_per_s)])
        if len(p.replicas) > 1:
            rows += [[f"  {r.qualname}", r.state, _pct(r.busy_frac), _pct(r.wait_input_frac),
                      _pct(r.blocked_output_frac), count(r.items_in_per_s),
                      count(r.items_out_per_s)] for r in p.replicas]
    return head, rows


def _plain_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(  # noqa: E731  (first column left-aligned, numbers right)
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def _what_if(summary: Summary) -> list[str]:
    """The what-if lines (:mod:`csp.observe.whatif`); none for a deadlocked run (nothing moves)."""
    return [] if summary.verdict.deadlock else what_if_lines(fit(summary))


def render_plain(summary: Summary, source: str = "run") -> str:
    """The report as plain text (what a non-terminal gets)."""
    parts = [_header_line(summary, source), summary.verdict.text, *_what_if(summary)]
    if summary.channels:
        parts += ["", _plain_table(*_channel_rows(summary))]
    if summary.processes:
        parts += ["", _plain_table(*_process_rows(summary))]
    return "\n".join(parts) + "\n"


def render_rich(summary: Summary, source: str = "run") -> Group:
    """The report as rich renderables (tables with the verdict on top)."""
    items: list = [Text(_header_line(summary, source), style="dim"),
                   Text(summary.verdict.text,
                        style="bold yellow" if summary.verdict.stage or summary.verdict.channel else "bold"),
                   *(Text(line) for line in _what_if(summary))]
    for (head, rows), title in ((_channel_rows(summary), "channels"),
                                (_process_rows(summary), "processes")):
        if not rows:
            continue
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row, style="dim" if row[0].startswith("  ") else None)
        items.append(table)
    return Group(*items)


def report(run: str | Path, *, window_s: float | None = None) -> Summary:
    """The summary of a run directory or stats file (see :func:`csp.observe.backpressure.summarize`)."""
    return summarize(read_stats(run), window_s)


def _wait_for_stats(run: str | Path, interval: float, sleep: Callable[[float], None]) -> Path:
    """The stats file of ``run``, waiting (and saying so once, on stderr) until it exists."""
    told = False
    while True:
        try:
            return stats_path(run)
        except FileNotFoundError as e:
            if not told:
                print(f"csp.inspect: waiting: {e}", file=sys.stderr)
                told = True
            sleep(interval)


def follow(run: str | Path, *, interval: float = 1.0, window_s: float | None = None,
           console: Console | None = None, as_json: bool = False,
           sleep: Callable[[float], None] = time.sleep, out: TextIO | None = None) -> Summary:
    """Tail a live run's stats log and show the report every ``interval`` seconds.

    Waits for the file to appear, stops after the final record (or on KeyboardInterrupt) and
    returns the last summary. ``sleep`` is injectable for tests.
    """
    out = out or sys.stdout
    console = console or Console(file=out)
    summary = summarize(StatsReader(), window_s)
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not as_json else None
    try:
        path = _wait_for_stats(run, interval, sleep)
        log = StatsReader(str(path))
        if live:
            live.start()
        with open(path, encoding="utf-8", errors="replace") as f:  # as read_stats reads it
            while True:
                chunk = f.read()
                if (log.feed(chunk) if chunk else 0) or log.feed_tail():
                    summary = summarize(log, window_s)
                    if as_json:
                        out.write(msgspec.json.encode(summary).decode() + "\n")
                        out.flush()
                    elif live:
                        live.update(render_rich(summary, str(run)), refresh=True)
                    else:
                        out.write(f"[t={summary.t_end:.1f}s] {summary.verdict.text}\n")
                        out.flush()
                if log.final is not None:
                    break
                sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if live:
            live.stop()
    if not as_json and not live:
        out.write(render_plain(summary, str(run)))
    return summary


EXIT_CODES = {0: "the report was printed (or --follow ended at the run's final record, or on Ctrl-C)",
              2: "no stats log in RUN (csp/stats.jsonl), a malformed one, a RUN file that is not a "
                 "stats log, or a bad option"}


def build_parser():
    """The command line of ``python -m csp.inspect`` (see ``--help``)."""
    parser = make_parser(
        "python -m csp.inspect", "Where is the backpressure in a csp run, and which stage is the bottleneck?",
        details="Reads RUN/csp/stats.jsonl and prints a verdict line (bottleneck: ...), then per channel its "
                "fill\n(now, average, peak of capacity), the share of time its senders were blocked and its "
                "receivers\nwaited, and its items/s and bytes/s (tensor bytes only; '-' when the items carry "
                "no tensors);\nper process replica the share of its time busy, waiting for input and blocked "
                "on output.\nThe rule behind the verdict: docs/inspect.md.",
        exit_codes=EXIT_CODES,
        examples=["python -m csp.inspect runs/dflash-tiny", "python -m csp.inspect runs/dflash-tiny --window 30",
                  "python -m csp.inspect runs/dflash-tiny --follow", "python -m csp.inspect runs/dflash-tiny --json"])
    parser.add_argument("run", help="run directory (with csp/stats.jsonl) or a stats.jsonl file")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="tail a live run: refresh until its final record (Ctrl-C to leave)")
    parser.add_argument("--interval", type=positive_float, default=1.0, metavar="SECONDS",
                        help="refresh period of --follow, in seconds")
    parser.add_argument("--window", type=positive_float, default=None, metavar="SECONDS",
                        help="analyse only the last SECONDS of the log, > 0 (default: the whole run)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (JSON lines with --follow) for scripts")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        if args.follow:
            follow(args.run, interval=args.interval, window_s=args.window, console=console,
                   as_json=args.json)
            return 0
        summary = report(args.run, window_s=args.window)
    except (FileNotFoundError, StatsFormatError) as e:
        print(f"csp.inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = msgspec.to_builtins(summary) | {"what_if": _what_if(summary)}
        sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
    elif console.is_terminal:
        console.print(render_rich(summary, args.run))
    else:
        sys.stdout.write(render_plain(summary, args.run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
