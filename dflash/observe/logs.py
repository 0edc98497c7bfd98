"""``python -m dflash.logs RUN_DIR``: what happened in a training run, from its files alone.

Reads ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/checkpoints/`` (:mod:`dflash.records`, :mod:`dflash.checkpoint.format`)
and reports:

* **Segments.** Each ``start`` record (one per ``dflash.run`` process) opens a segment: a fresh
  start from step 0 or a resume. Spikes and gaps are found within each segment, never across a
  restart; the segment list says where each began, from what, and how long the run was down.
* **Loss spikes.** Train record ``i`` is a spike when, with ``m`` the median and ``MAD`` the median
  absolute deviation of the finite losses of the previous ``window`` train records of its segment
  (at least ``min_history`` of them; the live monitor's history also starts with its process),
  ``loss_i > m + k * max(1.4826 * MAD, rel_floor * |m|)``. The factor 1.4826 makes the MAD
  estimate a standard deviation for normal noise (Hampel's identifier; see Rousseeuw & Croux 1993);
  the floor keeps a perfectly flat loss from flagging noise. A non-finite loss in a train record
  that averaged steps (``steps_averaged`` > 0) is always reported; a window whose every step was
  skipped (``steps_averaged`` 0) is not a spike, its steps are listed as skipped. Defaults: window
  20, k 5, floor 1 %.
* **Skipped steps**: every ``skip`` record (step, batch id, target replica, reason), and a warning
  when the last train record's ``skipped_total`` disagrees with the skip records of the steps it
  descends from (the segments back to the last fresh start, without steps a resume rewound).
* **Gaps in logging**: consecutive train records of one segment further apart in time than
  ``gap_factor`` (3) x the median interval. The cause is a checkpoint whose write
  ``[time - save_s, time]`` overlaps the gap, a ``resume`` record inside it, else ``stall``.
* **Checkpoints** with their health: every ``checkpoints/step_*`` (and leftover ``.tmp-*``)
  directory; ``meta.json`` gives step, loss and ``healthy``; a directory without ``meta.json`` is
  incomplete, one whose ``meta.json`` does not parse is damaged (said so, as ``dflash.eval`` and
  ``dflash.export`` say it), and one lacking a required file is listed with the files missing,
  never as complete. ``resume = "auto"``'s rule decides which one it would pick: the newest whose files
  and tensors pass :func:`dflash.checkpoint.resume.verify` (every newer one is listed with why it was
  rejected); older ones get the cheap check (files present, headers readable). Directories
  ``checkpoints/archive-*`` (an earlier lineage moved aside) are counted, not scanned.

Plain text by default; ``--json`` prints one JSON object for scripts. Exit status 2 when
``RUN_DIR/metrics.jsonl`` is missing.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from csp.cli import make_parser, positive_float, positive_int


def build_parser():
    """The ``dflash.logs`` parser (light: built before torch is imported, so ``--help`` answers at once)."""
    parser = make_parser(
        "python -m dflash.logs", "What happened in a dflash training run: loss spikes, skipped steps, "
        "logging gaps, checkpoint health.",
        details="Reads RUN_DIR/metrics.jsonl and RUN_DIR/checkpoints/ only (works on a finished, stopped or "
                "crashed run).\nA spike: loss > median + K x 1.4826 MAD of the previous WINDOW train "
                "records. A gap: an interval\nbetween train records > GAP_FACTOR x the median interval, "
                "with its cause (checkpoint, resume, restart, stall).\nThe checkpoint that resume = "
                "\"auto\" would pick is marked.",
        exit_codes={0: "the report was printed",
                    2: "no metrics.jsonl in RUN_DIR, or a --window, -k or --gap-factor that is not > 0"},
        examples=["python -m dflash.logs runs/dflash-tiny", "python -m dflash.logs runs/dflash-tiny --json"])
    parser.add_argument("run_dir", help="a dflash run directory (with metrics.jsonl)")
    parser.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    parser.add_argument("--window", type=positive_int, default=20, metavar="N",
                        help="spike rule: how many previous train records form the baseline")
    parser.add_argument("-k", type=positive_float, default=5.0, metavar="K",
                        help="spike rule: robust standard deviations (1.4826 x MAD) above the median")
    parser.add_argument("--gap-factor", type=positive_float, default=3.0, metavar="X",
                        help="gap rule: an interval longer than X times the median interval is a gap")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported (~1 s)
    build_parser().parse_args()

import msgspec  # noqa: E402

from dflash.checkpoint.health import CheckpointInfo, scan_archives, scan_checkpoints  # noqa: E402, F401 - re-exported
from dflash.observe.spikes import MAD_TO_STD, spike_threshold  # noqa: E402, F401 - re-exported
from dflash.records import EndRecord, Record, SkipRecord, TrainRecord, read_records  # noqa: E402


class Spike(msgspec.Struct, frozen=True):
    step: int
    loss: float
    median: float
    threshold: float
    steps_averaged: int | None = None


class Skip(msgspec.Struct, frozen=True):
    step: int
    batch_id: int | None
    reason: str
    replica: int | None = None  # the target replica that produced the batch


class Segment(msgspec.Struct, frozen=True):
    """One ``dflash.run`` process's part of the log (from one ``start`` record to the next)."""

    start_step: int | None  # the step it started from (0: fresh start); None before any start record
    resumed_from: str | None
    first_step: int | None  # first and last train record steps
    last_step: int | None
    end_status: str | None
    down_s: float | None  # seconds since the previous segment's last record


class Gap(msgspec.Struct, frozen=True):
    after_step: int
    before_step: int
    seconds: float
    typical_s: float
    cause: str


class LogReport(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    counts: dict[str, int]
    bad_lines: int
    last_step: int | None
    end_status: str | None
    skipped_total: int | None
    spikes: list[Spike]
    skips: list[Skip]
    gaps: list[Gap]
    checkpoints: list[CheckpointInfo]
    segments: list[Segment] = []
    archives: dict[str, int] = {}  # checkpoints/archive-* directory -> checkpoints in it
    descended_skips: int | None = None  # skip records of the steps the last train record descends from
    problems: list[str] = []  # "PATH line N: why" of the first bad lines


_PROBLEMS_SHOWN = 5

Rec = Mapping[str, Any]  # a metrics.jsonl record: a dflash.records record, or a dict with the same keys


def read_metrics(path: Path) -> tuple[list[Record], int]:
    """The records of a metrics.jsonl (:func:`dflash.records.read_records`) and the count of lines
    that are not records (a crashed writer's half line, an unknown kind). Raises FileNotFoundError."""
    records, problems = read_records(path)
    return records, len(problems)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def find_spikes(train: list[Rec], *, window: int = 20, k: float = 5.0,
                rel_floor: float = 0.01, min_history: int = 5) -> list[Spike]:
    """Loss spikes among ``train`` records (in file order) by the rule in the module docstring."""
    spikes, history = [], []
    for rec in train:
        loss, averaged = rec.get("loss"), rec.get("steps_averaged")
        if averaged == 0:
            continue  # every step of the window was skipped: listed as skips, not a spike
        if not _finite(loss):
            spikes.append(Spike(step=rec.get("step", -1), loss=float("nan") if loss is None else loss,
                                median=float("nan"), threshold=float("nan"), steps_averaged=averaged))
            continue
        got = spike_threshold(history, window=window, k=k, rel_floor=rel_floor, min_history=min_history)
        if got is not None and loss > got[1]:
            spikes.append(Spike(step=rec["step"], loss=loss, median=got[0], threshold=got[1],
                                steps_averaged=averaged))
        history.append(loss)
    return spikes


def split_segments(records: list[Rec]) -> list[list[Rec]]:
    """``records`` cut before every ``start`` record (records before the first one form their own
    segment)."""
    segments: list[list[Rec]] = []
    for r in records:
        if r.get("kind") == "start" or not segments:
            segments.append([])
        segments[-1].append(r)
    return segments


def describe_segments(records: list[Rec]) -> list[Segment]:
    """One :class:`Segment` per part of the log that one process wrote."""
    out, prev_end = [], None
    for seg in split_segments(records):
        start = seg[0] if seg[0].get("kind") == "start" else None
        resume = next((r for r in seg if r.get("kind") == "resume"), None)
        train = [r for r in seg if r.get("kind") == "train"]
        end = next((r for r in reversed(seg) if r.get("kind") == "end"), None)
        t0 = seg[0].get("time")
        out.append(Segment(
            start_step=start.get("step", 0) if start is not None else None,
            resumed_from=resume.get("path") if resume is not None else None,
            first_step=train[0].get("step") if train else None,
            last_step=train[-1].get("step") if train else None,
            end_status=end.get("status") if end is not None else None,
            down_s=t0 - prev_end if _finite(t0) and _finite(prev_end) else None,
        ))
        times = [r["time"] for r in seg if _finite(r.get("time"))]
        prev_end = max(times) if times else prev_end
    return out


def descended_skips(records: list[Rec]) -> list[Rec]:
    """The ``skip`` records of the steps the last segment descends from: its own, then, segment by
    segment back to the last fresh start, those at or before the step the next segment resumed
    from (a resume from an earlier step discards the later ones)."""
    out: list[Rec] = []
    upto = math.inf
    for seg in reversed(split_segments(records)):
        out += [r for r in seg if r.get("kind") == "skip" and r.get("step", 0) <= upto]
        start = seg[0] if seg[0].get("kind") == "start" else None
        if start is None or not start.get("step"):
            break  # a fresh start (or the log's beginning): nothing before it counts
        upto = start["step"]
    return out


def find_gaps(records: list[Rec], *, gap_factor: float = 3.0) -> list[Gap]:
    """Intervals between consecutive train records of one segment longer than ``gap_factor`` x the
    median such interval (a restart is a segment boundary, not a gap: see :func:`describe_segments`)."""
    segments = []
    for seg in split_segments(records):
        train = [r for r in seg if r.get("kind") == "train" and _finite(r.get("time"))]
        segments.append((seg, train, [b["time"] - a["time"] for a, b in zip(train, train[1:])]))
    deltas = [d for _, _, ds in segments for d in ds]
    if not deltas:
        return []
    typical = statistics.median(deltas)
    gaps = []
    for seg, train, ds in segments:
        for (a, b), dt in zip(zip(train, train[1:]), ds):
            if dt <= gap_factor * typical:
                continue
            t0, t1 = a["time"], b["time"]
            causes = []
            for r in seg:
                t = r.get("time")
                if not _finite(t):
                    continue
                if r["kind"] == "checkpoint" and not r.get("demoted") and t - (r.get("save_s") or 0.0) < t1 \
                        and t > t0:
                    causes.append(f"checkpoint at step {r.get('step')} (save {r.get('save_s', 0.0):.1f} s)")
                elif r["kind"] == "resume" and t0 < t <= t1:
                    causes.append(f"resume from {r.get('path')} at step {r.get('step')}")
            gaps.append(Gap(after_step=a.get("step", -1), before_step=b.get("step", -1), seconds=dt,
                            typical_s=typical, cause="; ".join(causes) or "stall"))
    return gaps


def analyse(run_dir: str | Path, *, window: int = 20, k: float = 5.0,
            gap_factor: float = 3.0) -> LogReport:
    """Everything ``python -m dflash.logs`` reports. Raises FileNotFoundError naming metrics.jsonl."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path}: is {run_dir} a dflash run directory?")
    records, problems = read_records(path)
    counts: dict[str, int] = {}
    for r in records:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    train = [r for r in records if isinstance(r, TrainRecord)]
    ends = [r for r in records if isinstance(r, EndRecord)]
    return LogReport(
        run_dir=str(run_dir), counts=counts, bad_lines=len(problems), problems=problems[:_PROBLEMS_SHOWN],
        last_step=train[-1].step if train else None,
        end_status=ends[-1].get("status") if ends else None,
        skipped_total=train[-1].get("skipped_total") if train else None,
        spikes=[s for seg in split_segments(records)
                for s in find_spikes([r for r in seg if isinstance(r, TrainRecord)], window=window, k=k)],
        skips=[Skip(step=r.step, batch_id=r.get("batch_id"), reason=str(r.get("reason")),
                    replica=r.get("replica")) for r in records if isinstance(r, SkipRecord)],
        gaps=find_gaps(records, gap_factor=gap_factor),
        checkpoints=scan_checkpoints(run_dir),
        segments=describe_segments(records),
        archives=scan_archives(run_dir),
        descended_skips=len(descended_skips(records)),
    )


def render(rep: LogReport, *, window: int = 20, k: float = 5.0, gap_factor: float = 3.0) -> str:
    """The report as plain text."""
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(rep.counts.items()))
    lines = [f"{rep.run_dir}: metrics.jsonl records: {kinds or 'none'}; last train step {rep.last_step}; "
             f"end: {rep.end_status or 'none (still running or crashed)'}"]
    if rep.bad_lines:
        lines.append(f"warning: {rep.bad_lines} metrics.jsonl line(s) are not JSON records (skipped)")
        lines += [f"  {p}" for p in rep.problems]
        if rep.bad_lines > len(rep.problems):
            lines.append(f"  ... and {rep.bad_lines - len(rep.problems)} more")
    lines.append(f"\nloss spikes ({len(rep.spikes)}; loss > median + {k:g} x 1.4826 MAD of the "
                 f"previous {window} train records):")
    for s in rep.spikes:
        averaged = f", mean of {s.steps_averaged} steps" if s.steps_averaged is not None else ""
        if math.isfinite(s.loss):
            lines.append(f"  step {s.step}: loss {s.loss:.4g} (median {s.median:.4g}, "
                         f"threshold {s.threshold:.4g}{averaged})")
        else:
            lines.append(f"  step {s.step}: loss {s.loss} (non-finite in a train record{averaged})")
    lines.append(f"\nskipped steps ({len(rep.skips)}; skipped_total at last train record: "
                 f"{rep.skipped_total}):")
    lines += [f"  step {s.step} batch {s.batch_id}"
              + (f" from target[{s.replica}]" if s.replica is not None and s.replica >= 0 else "")
              + f": {s.reason}" for s in rep.skips]
    expected = rep.descended_skips if rep.descended_skips is not None else len(rep.skips)
    if rep.skipped_total is not None and rep.skipped_total != expected:
        lines.append(f"  warning: skipped_total {rep.skipped_total} != {expected} skip records of the "
                     "steps it counts")
    lines.append(f"\nlogging gaps ({len(rep.gaps)}; interval > {gap_factor:g} x the median):")
    lines += [f"  steps {g.after_step} -> {g.before_step}: {g.seconds:.1f} s (typical "
              f"{g.typical_s:.1f} s), cause: {g.cause}" for g in rep.gaps]
    lines.append(f"\ncheckpoints ({len(rep.checkpoints)}; loss: the mean of the steps since the previous "
                 "checkpoint, as meta.json records it):")
    for c in rep.checkpoints:
        if not c.complete:  # no meta.json, an unreadable one, or a leftover .tmp-* save
            lines.append(f"  {c.name}: {c.problem or 'incomplete (no meta.json)'}")
            continue
        loss = f"{c.loss:.4g}" if _finite(c.loss) else str(c.loss)
        if not c.healthy:
            health = "UNHEALTHY" + (f": {c.problem}" if c.problem else "")
        elif c.problem:
            health = f"REJECTED: {c.problem}"
        else:
            health = "healthy"
        missing = f"{', '.join(c.missing)} missing"
        files = ("complete" if not c.missing else "" if missing in health else f"incomplete: {missing}")
        lines.append(f"  {c.name}: step {c.step}, loss {loss}, {health}" + (f", {files}" if files else "")
                     + (" <- resume=auto picks this" if c.auto_resume else ""))
    for name, n in rep.archives.items():
        lines.append(f"  {name}/: {n} checkpoint(s) a later start did not continue, moved aside (never resumed)")
    if len(rep.segments) > 1:
        lines.append(f"\nsegments ({len(rep.segments)}; one per dflash.run process):")
        for i, g in enumerate(rep.segments, 1):
            how = ("fresh start" if not g.start_step else f"resumed at step {g.start_step} from {g.resumed_from}")
            steps = f"steps {g.first_step}..{g.last_step}" if g.first_step is not None else "no train records"
            down = f", after {g.down_s:.1f} s down" if g.down_s is not None else ""
            lines.append(f"  {i}: {how}{down}: {steps}, end: {g.end_status or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rep = analyse(args.run_dir, window=args.window, k=args.k, gap_factor=args.gap_factor)
    except FileNotFoundError as e:
        print(f"dflash.logs: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.encode(rep).decode() + "\n")
    else:
        sys.stdout.write(render(rep, window=args.window, k=args.k, gap_factor=args.gap_factor))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
