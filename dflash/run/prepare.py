"""Everything that must exist before the graph starts: the tokenized data, the sampler positioned
at the first batch to train, the checkpoint to resume from, and the run's metrics log.

The step between the checked config and the running graph (:mod:`dflash.run.cli`); the data is
tokenized once and cached (:func:`dflash.data.load_dataset`), the checkpoint is chosen and verified
by :mod:`dflash.checkpoint.resume`, and the start (and resume) records open ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from dflash.checkpoint import check_architecture, list_checkpoints
from dflash.checkpoint.config_changes import changes_since
from dflash.checkpoint.resume import archive_foreign, new_lineage
from dflash.checkpoint.resume import choose as choose_resume
from dflash.observe import runlog
from dflash.observe.metrics_writer import MetricsLog
from dflash.records import HeldoutRecord, ResumeRecord, StartRecord, read_records
from dflash.run.app import ResumeState, RunApp
from dflash.run.config import added_later_keys
from dflash.run.resolve import Resolved

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["MIN_TRAIN", "prepare"]

MIN_TRAIN = 16
"""The fewest conversations a run trains on: below it a drafter only memorises its data, and the
held-out figures say nothing; the run stops before training with one line (exit 2)."""

log = logging.getLogger("dflash.run")


def prepare(resolved: Resolved, resume: str, tok: PreTrainedTokenizerBase | None = None) -> RunApp:
    """Everything that must exist before the graph starts: data, sampler, resume state.

    ``tok``: the tokenizer :func:`dflash.run.resolve.load_and_resolve` loaded (loaded again when None).

    Raises:
        dflash.data.DataError: unusable data (message names the file and the reasons).
        CheckpointError: the requested checkpoint cannot be used.
    """
    # looked up at call time (not imported at module level), so a test can replace load_dataset
    from dflash.data import (
        DataError,
        Sampler,
        load_dataset,
        load_tokenizer,
        tokenizer_info,
    )

    cfg = resolved.cfg
    run_dir = Path(cfg.run.out_dir)
    if tok is None:
        tok = load_tokenizer(cfg.target.tokenizer_source)
    info = tokenizer_info(tok)
    dataset = load_dataset(cfg.data, tok, console=runlog.console())
    if dataset.summary is not None:
        log.info(runlog.data_line(dataset.summary), extra=runlog.FILE_ONLY)  # the terminal got the table
    try:
        train, heldout = dataset.split(cfg.data.holdout, cfg.data.seed)  # heldout: python -m dflash.eval
    except ValueError as exc:
        raise DataError(f"{exc}; lower data.holdout") from exc
    if train.same_prompt_dropped:
        log.info("data: %d conversations not trained on: their prompt is a held-out conversation's (another "
                 "answer to it, or a repeated prompt), so held-out figures measure unseen prompts",
                 train.same_prompt_dropped)
    if len(train) < MIN_TRAIN:
        raise DataError(f"{cfg.data.source}: {len(dataset)} usable conversations, {len(heldout)} held out "
                        f"(data.holdout) leaves {len(train)} to train on, fewer than {MIN_TRAIN}: give more "
                        "conversations, or lower data.holdout")
    if resolved.evaluator.eval.every > 0:
        _check_eval_prompts(cfg, tok, train, heldout)
    sampler = Sampler(train, cfg.data, pad_id=info.pad_token_id)

    rank = int(os.environ.get("RANK", "0"))  # under torchrun, ranks > 0 log beside their csp stats
    # when auto rejects every checkpoint there was, choose_resume itself says the run starts at step 0
    found = bool(list_checkpoints(run_dir / "checkpoints"))
    got = choose_resume(run_dir, resume)  # logs a REJECTED line for each checkpoint it passes over
    state, changes = ResumeState(), []
    if got is not None:
        state = ResumeState(start_step=got.step, path=got.path, train_state=got.train_state, weights=got.weights)
        changes = changes_since(got, json.loads(msgspec.json.encode(cfg)), resolved.config_hash, added_later_keys())
        try:
            sampler.load_state_dict(got.train_state["sampler"])
        except DataError as exc:  # name the settings behind the data order's fingerprint
            if not changes:
                raise
            raise DataError(f"{exc}; changed since {got.path}: " + "; ".join(changes[:8])) from None
        if changes:
            log.warning("the config differs from the one checkpoint %s was trained with: %s", got.path,
                        "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else ""))
        if runlog.console().is_terminal:
            runlog.console().rule(f"[bold yellow]RESUMING from step {got.step}: {got.path}")
        log.warning("RESUMING from step %d: %s", got.step, got.path)
        check_architecture(got.path, resolved.drafter)
    state.lineage = (got.lineage if got is not None else None) or new_lineage()
    if rank == 0:  # one lineage per checkpoints/ directory (dflash.checkpoint.resume)
        archived, moved = archive_foreign(run_dir / "checkpoints", got)
        if archived is not None:
            log.warning("moved %d checkpoint(s) this run does not continue (%s) to %s; delete that "
                        "directory when you no longer need them", len(moved), ", ".join(moved), archived)
    if got is None and resume != "none" and not found:
        log.info("no checkpoint to resume in %s; starting from step 0", run_dir / "checkpoints")
    metrics = MetricsLog(run_dir / "metrics.jsonl" if rank == 0 else run_dir / f"rank{rank}" / "metrics.jsonl")
    app = RunApp(resolved=resolved, run_dir=run_dir, sampler=sampler, metrics=metrics, resume=state)
    if got is not None:  # [checkpoint].keep_best: the best evaluation of the earlier segments stays kept
        app.progress.best = best_heldout(run_dir / "metrics.jsonl", got.step)
    stats = sampler.epoch_stats(sampler.epoch)
    log.info("data: %d training conversations (%d more held out, never trained on: data.holdout; held-out tau "
             "decodes the first %d, eval.prompts, and dflash.eval --data up to all), %s batching: "
             "padding waste %.1f%%, %d batches/epoch",
             len(train), len(heldout), min(cfg.eval.prompts, len(heldout)), cfg.data.strategy,
             100 * stats.padding_waste, stats.num_batches)
    metrics.write(StartRecord(config_hash=resolved.config_hash, step=state.start_step, lineage=state.lineage,
                              data=dataset.summary.to_dict(), batching=msgspec.to_builtins(stats)))
    if got is not None:
        metrics.write(ResumeRecord(step=state.start_step, path=str(got.path),
                                   rejected=[{"path": str(p), "reason": r} for p, r in got.rejected],
                                   config_changes=changes))
    return app


def _check_eval_prompts(cfg, tok, train, heldout) -> None:
    """The in-training evaluator decodes from the held-out conversations' prompts; when none has
    one (each opens with an assistant turn) say so before start-up, with advice that fits the data.

    Raises:
        dflash.data.DataError: no held-out conversation gives a prompt.
    """
    from dflash.data import DataError
    from dflash.data.prompts import usable_prompts

    if usable_prompts(heldout, tok, cfg.data, 1, 1):
        return
    what = (f"[eval]: none of the {len(heldout)} held-out conversations of {cfg.data.source} has a user turn "
            f"before its first assistant turn, so eval.every = {cfg.eval.every} has no prompt to decode")
    if usable_prompts(train, tok, cfg.data, 1, 1):  # some conversations do: a larger or other draw finds them
        raise DataError(f"{what}; raise data.holdout or change data.seed (the held-out draw), or set eval.every = 0")
    raise DataError(f"{what}, nor has any of its conversations (each opens with an assistant turn); "
                    "set eval.every = 0, and measure the drafter after training with python -m dflash.eval "
                    "CKPT --prompts FILE.jsonl on prompts that open with a user turn")


def best_heldout(path: Path, upto: int) -> tuple[int, float] | None:
    """``(step, tau)`` of the best held-out evaluation in the metrics log ``path`` at or before step
    ``upto`` (the resumed checkpoint's: later ones measured weights this run does not continue), or
    None (no log, no evaluation)."""
    try:
        records, _ = read_records(path)
    except OSError:
        return None
    held = [(r.step, r.tau) for r in records if isinstance(r, HeldoutRecord) and isinstance(r.tau, (int, float))
            and math.isfinite(r.tau) and isinstance(r.step, int) and r.step <= upto]
    return max(held, key=lambda st: st[1]) if held else None
