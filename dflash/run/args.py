"""The command line of ``python -m dflash.run`` (light: importing it imports no torch, so ``--help``
answers at once)."""

from __future__ import annotations

import argparse
from pathlib import Path

from csp._guard import check as _check_owner
from csp.cli import make_parser

# Under another distribution's dflash/__init__ (an editable install still finds this module):
_check_owner("dflash", Path(__file__).parent.parent)

INTERRUPTED_STARTING = ("dflash.run: interrupted while starting, before any step ran; nothing new was saved: "
                        "run the same command again")

EXIT_CODES = {
    0: "training finished ([run].steps reached), or nothing to do (the checkpoint is already there)",
    1: "a stage failed (the error names it: target[1], drafter[0] ...), or a checkpoint or data "
       "problem was found at run time; the summary names the last healthy checkpoint",
    2: "bad graph file, config, --set value or data (nothing was trained)",
    3: "a stage did not stop within 10 s of an abort (stuck outside a channel call); the line names it "
       "and the process leaves at once, its thread abandoned",
    4: "disk full: a checkpoint could not be written (no space left on the device the line names); its "
       "partial files were removed and the last good checkpoint is intact (free space, --resume auto)",
    5: "deadlocked: every stage waited on a channel and nothing moved for [runtime].deadlock_timeout_s "
       "(30 s; 0 = off); the error names the cycle of waits",
    130: "stopped by Ctrl-C or SIGTERM: the graph drained and a final checkpoint was written "
         "(or, after a second signal, aborted without one); an evaluation in progress ends unfinished "
         "and the summary names its step",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash.run`` parser (see ``python -m dflash.run --help``)."""
    p = make_parser(
        "python -m dflash.run", "Train a DFlash drafter: run the graph file's "
        "prefetch -> target -> postprocess -> drafter -> monitor pipeline (and the held-out evaluator "
        "beside it).",
        details="Reads and validates GRAPH, tokenizes the data (cached), resumes from a checkpoint if asked, "
                "trains,\nand prints a closing summary (steps, loss, tau, throughput, checkpoint, next "
                "commands). Everything\ngoes to RUN_DIR/run.log and RUN_DIR/metrics.jsonl ([run].out_dir). "
                "Ctrl-C (or SIGTERM) stops\ngracefully: the graph drains and a final checkpoint is "
                "written; a second Ctrl-C aborts.\nNew settings belong in the graph file; --set overrides "
                "one key for one run.",
        exit_codes=EXIT_CODES,
        examples=["python -m dflash.run examples/dflash-tiny.toml",
                  "python -m dflash.run examples/dflash-tiny.toml --set run.steps=20 --set process.target.replicas=1",
                  "python -m dflash.run examples/dflash-tiny.toml --resume none --set run.out_dir=runs/fresh"])
    p.add_argument("graph", help="graph file (TOML), e.g. examples/dflash-tiny.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key for this run, e.g. --set run.steps=50 "
                        "--set process.target.replicas=1 (repeatable; values are TOML)")
    p.add_argument("--resume", default=None, metavar="auto|none|PATH",
                   help="auto: the newest healthy checkpoint in RUN_DIR/checkpoints; none: start at step 0; "
                        "PATH: that checkpoint directory (default: [run].resume of the graph file, \"auto\")")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


__all__ = ["EXIT_CODES", "build_parser", "parse_args"]
