"""From a validated graph file to what the run needs: every cross-table check, each stage's options.

:func:`resolve` is the one step between reading the graph file and loading data::

    load_config -> csp.Graph.from_spec -> load_tokenizer -> resolve -> (lock, data, resume) -> run

Each table validated itself when the file was decoded (:mod:`dflash.run.config`); ``resolve`` checks
the tables against each other (:mod:`dflash.run.preflight`: drafter vs target depth and width, the
captured layer ids, attention implementation vs device, the monitor's backend, data-parallel
drafters vs the launcher; then the mask token vs the tokenizer), fills what the tokenizer decides
(``[target].vocab_size`` of a preset target, ``[drafter].mask_token_id``, ``[data].block_size``)
into a *new* file, and builds each stage's frozen options from it. It never mutates its input,
writes nothing and loads no data; it reads the target's transformers ``config.json`` (never its
weights).
"""

from __future__ import annotations

import msgspec
import torch

import csp.dist
from dflash.data import TokenizerInfo
from dflash.errors import ConfigError
from dflash.model.drafter import DrafterConfig
from dflash.model.features import FeaturePostprocess
from dflash.run.config import DFlashFile, config_hash
from dflash.run.preflight import (
    check_block_fits,
    check_drafter_attention,
    check_drafter_replicas,
    check_model_shapes,
    check_monitor_backend,
    drafter_replicas,
    lr_warnings,
)
from dflash.run.stages.monitor import MonitorOptions
from dflash.run.stages.postprocess import PostprocessOptions
from dflash.run.stages.prefetch import PrefetchOptions
from dflash.run.stages.target import TargetStageOptions
from dflash.run.stages.trainer import DrafterStageOptions
from dflash.train.loss import needs_final_hidden, uses_head

__all__ = ["Resolved", "resolve"]


class Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """The checked run configuration (frozen; built by :func:`resolve`).

    Attributes:
        cfg: the filled graph file: what ``RUN_DIR/config.toml``, the checkpoints'
            ``train_config.json`` and :attr:`config_hash` are made from.
        drafter: the drafter config resolved against the target (every dimension set).
        config_hash: :func:`dflash.run.config.config_hash` of ``cfg``.
        warnings: one line each, for settings that are legal but almost certainly unintended.
        prefetch, target, postprocess, trainer, monitor: the options of the stage kinds
            ``dflash.prefetch``, ``dflash.target``, ``dflash.postprocess``, ``dflash.drafter``
            and ``dflash.monitor``.
    """

    cfg: DFlashFile
    drafter: DrafterConfig
    config_hash: str
    warnings: tuple[str, ...]
    prefetch: PrefetchOptions
    target: TargetStageOptions
    postprocess: PostprocessOptions
    trainer: DrafterStageOptions
    monitor: MonitorOptions


def filled(cfg: DFlashFile, tokenizer: TokenizerInfo) -> DFlashFile:
    """A copy of ``cfg`` with what the tokenizer decides: ``[target].vocab_size`` (a preset target
    that sets none), ``[drafter].mask_token_id`` (when unset) and ``[data].block_size``
    (= ``[drafter].block_size``); and ``[drafter].confidence_head`` from ``[loss].confidence``
    (the head exists iff the loss trains it). ``cfg`` is not changed; untouched tables are shared.

    Raises:
        ConfigError: no ``drafter.mask_token_id`` and the tokenizer has no mask token, or
            ``drafter.confidence_head = true`` without ``loss.confidence = "head"``.
    """
    replace = msgspec.structs.replace
    target = cfg.target
    if target.path is None and target.vocab_size is None:
        target = replace(target, vocab_size=tokenizer.vocab_size)
    drafter = cfg.drafter
    if drafter.mask_token_id is None:
        if tokenizer.mask_token_id is None:
            raise ConfigError("[drafter].mask_token_id is not set and the tokenizer has no mask token: "
                              "set drafter.mask_token_id to an unused token id")
        drafter = replace(drafter, mask_token_id=tokenizer.mask_token_id)
    head = uses_head(cfg.loss)
    if drafter.confidence_head and not head:
        raise ConfigError("drafter.confidence_head = true adds a head nothing trains: set loss.confidence = 'head' "
                          "(with loss.conf_weight > 0) instead, and leave drafter.confidence_head unset")
    if drafter.confidence_head != head:
        drafter = replace(drafter, confidence_head=head)
    data = replace(cfg.data, block_size=drafter.block_size)
    return replace(cfg, target=target, drafter=drafter, data=data)


def _uses_cuda(cfg: DFlashFile) -> bool:
    return any((p.device or "").startswith("cuda") or any(d.startswith("cuda") for d in (p.devices or []))
               for p in cfg.process)


def resolve(cfg: DFlashFile, tokenizer: TokenizerInfo) -> Resolved:
    """Check ``cfg`` across its tables, fill it from ``tokenizer`` and build every stage's options.

    Args:
        cfg: a graph file from :func:`dflash.run.config.load_config` (not changed).
        tokenizer: the target tokenizer's vocabulary size and special ids
            (:func:`dflash.data.tokenizer_info`).

    Returns:
        the :class:`Resolved` run configuration.

    Raises:
        ConfigError: the first cross-table mistake, one line naming the key path to change.
    """
    check_monitor_backend(cfg)
    full = filled(cfg, tokenizer)
    drafter = check_model_shapes(full)
    check_block_fits(full)
    check_drafter_attention(full)
    check_drafter_replicas(full, launched=csp.dist.launched())
    run, train = full.run, full.train
    features = FeaturePostprocess(noise=train.feature_noise, seed=run.seed, side=train.postprocess_side)
    digest = config_hash(full)
    return Resolved(
        cfg=full,
        drafter=drafter,
        config_hash=digest,
        warnings=tuple(lr_warnings(full)),
        prefetch=PrefetchOptions(seed=run.seed, num_anchors=train.num_anchors, block_size=drafter.block_size,
                                 pin=_uses_cuda(full) and torch.cuda.is_available(),
                                 drafters=drafter_replicas(full), check_channels=train.check_channels),
        target=TargetStageOptions(target=full.target, num_draft_layers=drafter.num_layers,
                                  need_final=needs_final_hidden(full.loss), features=features,
                                  check_channels=train.check_channels),
        postprocess=PostprocessOptions(features=features, host_staging=train.host_staging,
                                       check_channels=train.check_channels),
        trainer=DrafterStageOptions(drafter=drafter, target=full.target, seed=run.seed, total_steps=run.steps,
                                    train=train, loss=full.loss, checkpoint_every=full.checkpoint.every,
                                    keep_last=full.checkpoint.keep_last, config_hash=digest, train_config=full),
        monitor=MonitorOptions(window=full.monitor.window, wandb=full.monitor.wandb,
                               wandb_project=full.monitor.wandb_project, display=full.monitor.display,
                               spike_k=full.monitor.spike_k, run_name=run.name, total_steps=run.steps,
                               wandb_config=msgspec.to_builtins(full)),
    )
