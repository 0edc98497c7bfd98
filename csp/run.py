"""Run any csp graph file: ``python -m csp.run GRAPH.toml [--set key=value ...] [--run-dir DIR]``.

Reads and validates the file (``plugins`` are imported so their kinds register), builds the graph,
runs it, prints how it ended and a per-process summary, and exits with the run's exit code:
0 completed, 130 stopped by Ctrl-C or SIGTERM (graceful drain; a second signal aborts), 1 a process failed,
2 bad graph or config, 3 a process did not stop after an abort, 4 deadlocked (``EXIT_CODES``). Statistics and the trace go to ``RUN_DIR/csp/`` (default
``runs/<graph file stem>``; ``--no-run-dir`` writes nothing).

Examples::

    python -m csp.run examples/text_pipeline.toml
    python -m csp.run examples/text_pipeline.toml --set process.tokenize.replicas=1 --set trace.flows=true
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Sequence

from csp.cli import make_parser
from csp.errors import GraphError, ProcessFailed, ProcessStuck
from csp.graph import Graph, load_spec
from csp.runtime.engine import EXIT_BAD_GRAPH, EXIT_FAILED, EXIT_STUCK, Runtime

EXIT_CODES = {
    0: "completed",
    1: "a process failed (the error line names it, e.g. tokenize[1])",
    2: "bad graph file, --set value or plugin (nothing started)",
    3: "a process did not stop within 10 s of an abort (stuck outside a channel call); the line names it",
    4: "deadlocked: every live process waited on a channel and nothing moved for "
       "[runtime].deadlock_timeout_s (30 s; 0 = off); the error line names the cycle of waits",
    130: "stopped by Ctrl-C or SIGTERM (graceful drain), or aborted by a second signal",
}


DFLASH_TABLES = ("run", "data", "target", "drafter", "loss", "train", "checkpoint", "monitor", "eval")
"""The top-level tables a DFlash graph file has beyond csp's own (``dflash.run.config.DFlashFile``):
an unknown-field error on one of them says the file is for ``python -m dflash.run``."""


def dflash_hint(exc: GraphError, graph: Path) -> str:
    """``"; ... python -m dflash.run GRAPH"`` when ``exc`` is the unknown top-level field error of a
    :data:`DFLASH_TABLES` table written in the file (not set by ``--set``), else ``""``."""
    m = re.search(r": Object contains unknown field `([^`]*)`$", str(exc))
    if m is None or m.group(1) not in DFLASH_TABLES:
        return ""
    return f"; [{m.group(1)}] is a table of DFlash graph files: run this one with python -m dflash.run {graph}"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m csp.run`` (see ``--help``)."""
    ap = make_parser(
        "python -m csp.run", "Run any csp graph file, then print how it ended and a per-process summary.",
        details="Statistics and the trace go to RUN_DIR/csp/ (read them with python -m csp.inspect RUN_DIR).\n"
                "The first Ctrl-C (or SIGTERM) stops the sources and drains the items in flight; a second "
                "one aborts.",
        exit_codes=EXIT_CODES,
        examples=["python -m csp.run examples/text_pipeline.toml",
                  "python -m csp.run examples/text_pipeline.toml --set process.tokenize.replicas=1 "
                  "--set trace.flows=true"])
    ap.add_argument("graph", type=Path, help="graph file (TOML)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a graph value, e.g. process.tokenize.replicas=1 (repeatable)")
    ap.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                    help="where csp/stats.jsonl and csp/trace.json go (default: runs/<graph file stem>)")
    ap.add_argument("--no-run-dir", action="store_true", help="write no statistics or trace")
    ap.add_argument("--allow-imports", action="store_true",
                    help="accept 'module:Class' import strings as process kinds")
    ap.add_argument("-q", "--quiet", action="store_true", help="log only warnings and errors")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (see ``EXIT_CODES``)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        spec = load_spec(args.graph, overrides=args.overrides)
        graph = Graph.from_spec(spec, allow_imports=args.allow_imports)
    except GraphError as exc:
        print(f"error: {exc}{dflash_hint(exc, args.graph)}", file=sys.stderr)
        return EXIT_BAD_GRAPH
    run_dir = None if args.no_run_dir else (args.run_dir or Path("runs") / args.graph.stem)
    from csp.distributed import launched

    if launched():  # under torchrun: run this rank's share (docs/distributed.md)
        from csp.distributed.launch import cli

        return cli(graph, run_dir)
    runtime = Runtime(graph, run_dir=run_dir)
    try:
        result = runtime.run()
    except ProcessFailed as exc:
        print(f"error: {exc} (traceback above; cause: {exc.__cause__!r})", file=sys.stderr)
        return EXIT_FAILED
    except ProcessStuck as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_STUCK
    if result.deadlock is not None:
        print(f"error: deadlock: {result.deadlock}", file=sys.stderr)
    how = f"{result.status} by {result.stopped_by}" if result.stopped_by and not result.deadlock else result.status
    print(f"{how} in {result.duration_s:.2f} s (exit code {result.exit_code})")
    for q, st in runtime.statistics()["processes"].items():
        print(f"  {q:<20} busy {st.busy_s:7.3f} s  wait_input {st.wait_input_s:7.3f} s  "
              f"blocked_output {st.blocked_output_s:7.3f} s  in {st.items_in:>7}  out {st.items_out:>7}")
    if run_dir is not None:
        print(f"statistics: {run_dir / 'csp' / 'stats.jsonl'}   trace: {run_dir / 'csp' / 'trace.json'}")
    return result.exit_code


if __name__ == "__main__":
    code = main()
    if code == EXIT_STUCK:  # a thread still runs native code: shutdown could abort (SIGABRT, 134), not exit 3
        from csp.distributed import hard_exit

        hard_exit(code)
    sys.exit(code)
