"""Each DFlash stage's frozen options, as :func:`dflash.run.resolve.resolve` builds them from the
resolved graph file.

They live apart from the stages that read them (:mod:`dflash.run.stages`) so that resolving a
config imports no stage and no run-time object: ``resolve -> options`` and ``stages -> options``,
never a path back. A stage reads only its own options (``app.resolved.<stage>``), never the graph
file.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from dflash.data import DataConfig
from dflash.eval.config import EvalSection
from dflash.model.drafter_config import DrafterConfig
from dflash.model.features import FeaturePostprocess
from dflash.model.target_config import TargetConfig
from dflash.run.config import DFlashFile
from dflash.train.config import TrainSection
from dflash.train.loss import LossConfig

__all__ = ["DrafterStageOptions", "EvaluatorOptions", "MonitorOptions", "PostprocessOptions", "PrefetchOptions", "TargetStageOptions"]


class PrefetchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dflash.prefetch`` needs (built by :func:`dflash.run.resolve.resolve`).

    Attributes:
        seed: ``[run].seed``; with the batch id it seeds each batch's anchors.
        num_anchors: ``[train].num_anchors``, anchor slots per row (``A``).
        block_size: ``[drafter].block_size`` (``bs``): an anchor needs ``bs - 1`` tokens after it.
        pin: copy each batch to page-locked memory (a CUDA device is available and the graph uses one).
        drafters: data-parallel drafter replicas; each takes one batch per optimizer step.
        check_channels: ``[train].check_channels``, the debug non-finite check of every item sent.
    """

    seed: int
    num_anchors: int
    block_size: int
    pin: bool
    drafters: int = 1
    check_channels: bool = False


class TargetStageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dflash.target`` needs (built by :func:`dflash.run.resolve.resolve`).

    Attributes:
        target: the ``[target]`` table (``vocab_size`` filled from the tokenizer for a preset).
        num_draft_layers: ``[drafter].num_layers`` (the default captured layers depend on it).
        need_final: the loss needs target logits, so the final hidden state is returned too.
        features: the feature noise, added here when ``[train].postprocess_side = "target"``.
        check_channels: ``[train].check_channels``.
    """

    target: TargetConfig
    num_draft_layers: int
    need_final: bool
    features: FeaturePostprocess
    check_channels: bool = False


class PostprocessOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dflash.postprocess`` needs (built by :func:`dflash.run.resolve.resolve`).

    Attributes:
        features: the feature noise, added here when ``[train].postprocess_side = "drafter"``.
        host_staging: ``[train].host_staging``, move through host memory instead of device to device.
        check_channels: ``[train].check_channels``.
    """

    features: FeaturePostprocess
    host_staging: bool = False
    check_channels: bool = False


class DrafterStageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dflash.drafter`` needs (built by :func:`dflash.run.resolve.resolve`).

    Attributes:
        drafter: the resolved drafter config (every dimension set, ``target_layer_ids`` chosen).
        target: the ``[target]`` table, for the shared embedding and LM head and the checkpoint.
        seed: ``[run].seed``, seeds the drafter's init.
        total_steps: ``[run].steps``, steps in total counting those before a resume (the schedule's end).
        train: ``[train]`` (optimizer, schedule, loss switches, the non-finite streak).
        loss: ``[loss]``.
        checkpoint_every, keep_last, keep_best: ``[checkpoint].every`` (0: only at the end),
            ``keep_last`` and ``keep_best``.
        config_hash: :func:`dflash.run.config.config_hash` of the filled file, stored in checkpoints.
        train_config: the filled graph file, written as is into each checkpoint's train_config.json.
        eval_every: ``[eval].every``: a weight snapshot goes to the ``snapshots`` output (when the
            graph connects it) every this many steps, and after the last one; 0 = none.
        time_budget_s: ``[run].time_budget_s`` (seconds of training; the schedule's end follows
            the measured step rate), or None.
    """

    drafter: DrafterConfig
    target: TargetConfig
    seed: int
    total_steps: int
    train: TrainSection
    loss: LossConfig
    checkpoint_every: int
    keep_last: int
    config_hash: str
    keep_best: bool = True
    train_config: DFlashFile
    eval_every: int = 0
    time_budget_s: float | None = None


class EvaluatorOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dflash.evaluator`` needs (built by :func:`dflash.run.resolve.resolve`).

    Attributes:
        drafter: the resolved drafter config (the snapshots' shapes).
        target: the ``[target]`` table: the evaluator loads its own copy for generation.
        data: the ``[data]`` table: the held-out conversations are ``split(holdout, seed)[1]`` of it.
        eval: ``[eval]`` (prompts, generation length, temperature).
    """

    drafter: DrafterConfig
    target: TargetConfig
    data: DataConfig
    eval: EvalSection


class MonitorOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dflash.monitor`` needs (built by :func:`dflash.run.resolve.resolve`).

    Attributes:
        window: ``[monitor].window``, steps per logged point.
        wandb, wandb_project: ``[monitor].wandb`` ("offline", "online", "disabled") and its project.
        display: ``[monitor].display`` ("auto", "live", "plain", "off").
        spike_k: ``[monitor].spike_k``, robust standard deviations above the median that flag a spike.
        run_name: ``[run].name``.
        total_steps: ``[run].steps``, for progress and ETA.
        wandb_config: the filled graph file as plain data, logged as the wandb run's config.
    """

    window: int
    wandb: Literal["offline", "online", "disabled"]
    wandb_project: str
    display: Literal["auto", "live", "plain", "off"]
    spike_k: float
    run_name: str
    total_steps: int
    wandb_config: dict[str, Any] = msgspec.field(default_factory=dict)
