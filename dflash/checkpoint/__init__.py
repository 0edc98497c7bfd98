"""Everything a run keeps on disk: one home for the checkpoint format, written and read.

* :mod:`dflash.checkpoint.format`: the layout, file names and ``meta.json`` (:class:`Meta`); listing,
  reading and validating a checkpoint directory.
* :mod:`dflash.checkpoint.writer`: :class:`Checkpointer` (background, atomic, non-stalling saves,
  ``keep_last`` retention); :mod:`dflash.checkpoint.snapshot`: what it saves (:class:`Snapshot`)
  and the health rule; :mod:`dflash.checkpoint.config`: the ``[checkpoint]`` table.
* :mod:`dflash.checkpoint.files`: atomic small-file writes: JSON, :func:`mark_unhealthy`,
  per-replica state files (:func:`write_rank_state`).
* :mod:`dflash.checkpoint.resume`: which checkpoint a run continues from, verified; one lineage
  per directory; what a config change does.
* :mod:`dflash.checkpoint.model_files`: the drafter part of a checkpoint (weights and configs).
* :mod:`dflash.checkpoint.init_from`: ``[train].init_from``, a fresh run's drafter starting from the
  weights of a checkpoint or an exported drafter: checked before any data work, then loaded.
* :mod:`dflash.checkpoint.config_changes`: what differs between a checkpoint's training config and
  the run's, and what each difference does (the lines of a resume's report).
* :mod:`dflash.checkpoint.health`: every checkpoint's health and the one ``resume = "auto"`` picks
  (what ``python -m dflash.logs`` prints).

Every public name of format, writer, files and resume is importable from here (model_files and
init_from are not re-exported: they import the models, and the reports that read a run directory
need none). Imports: :mod:`dflash.model` (at module level in model_files and init_from only),
:mod:`dflash.records`, :mod:`dflash.errors` and csp; never the trainer or the run, so eval, export
and the reports read a checkpoint without them.
"""

from dflash.checkpoint.config_changes import changes_since, config_changes, saved_config
from dflash.checkpoint.files import mark_unhealthy, write_rank_state
from dflash.checkpoint.format import (
    ARCHIVE_PREFIX,
    DRAFTER_CONFIG,
    META,
    PREFIX,
    RANK_STATE,
    REQUIRED_FILES,
    TARGET_CONFIG,
    TMP_PREFIX,
    TRAIN_CONFIG,
    TRAIN_STATE,
    TRAIN_TENSORS,
    WEIGHTS,
    CheckpointError,
    Meta,
    check_files,
    is_checkpoint_dir,
    is_healthy,
    list_checkpoints,
    load_train_state,
    nonfinite_tensors,
    rank_state_files,
    rank_state_path,
    read_meta,
    read_rank_state,
    run_dir_checkpoints,
    step_dir,
)
from dflash.checkpoint.resume import (
    Resume,
    archive_foreign,
    check_architecture,
    check_optimizer,
    check_resume_path,
    choose,
    new_lineage,
    resolve_resume,
    resume_candidate,
    verify,
)
from dflash.checkpoint.snapshot import Snapshot, health_reason
from dflash.checkpoint.writer import Checkpointer

__all__ = [
    "ARCHIVE_PREFIX", "DRAFTER_CONFIG", "META", "PREFIX", "RANK_STATE", "REQUIRED_FILES", "TARGET_CONFIG",
    "TMP_PREFIX", "TRAIN_CONFIG", "TRAIN_STATE", "TRAIN_TENSORS", "WEIGHTS", "CheckpointError",
    "Checkpointer", "Meta", "Resume", "Snapshot", "archive_foreign", "changes_since", "check_architecture",
    "check_optimizer", "check_files", "check_resume_path", "choose", "config_changes", "health_reason",
    "is_checkpoint_dir", "is_healthy", "list_checkpoints", "load_train_state", "mark_unhealthy", "new_lineage", "nonfinite_tensors",
    "rank_state_files", "rank_state_path", "read_meta", "read_rank_state", "resolve_resume", "resume_candidate",
    "run_dir_checkpoints",
    "saved_config", "step_dir", "verify", "write_rank_state",
]
