"""From a loaded graph file to what the run needs: the file filled from the target and its
tokenizer, the drafter resolved against the target, and each stage's options.

The second step of the one pass from a graph file to a running graph::

    load_config -> load_and_resolve -> validate -> csp.Graph.from_spec -> (lock, data, resume) -> run

:func:`load_and_resolve` reads the target's transformers ``config.json`` (never its weights) and
its tokenizer, then :func:`resolve` fills what they decide (``[target].vocab_size`` of a preset
target, ``[drafter].mask_token_id``, ``[data].block_size``) into a *new* file, resolves the
drafter's dimensions and captured target layers, and builds each stage's frozen options
(:mod:`dflash.run.options`). It never mutates its input, writes nothing, loads no data and checks
no rule beyond what resolving needs (a target it cannot read, drafter dimensions that cannot fit
the target): the rules of the resolved run are :func:`dflash.run.validate.validate`'s.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import msgspec
import torch

import dflash.data
from dflash.data import TokenizerInfo
from dflash.data.sources import resolve_source
from dflash.errors import ConfigError
from dflash.model.drafter_config import DrafterConfig
from dflash.model.features import FeaturePostprocess
from dflash.model.layer_ids import check_not_last_layer, resolve_layer_ids
from dflash.model.target_config import TargetConfig, build_hf_config
from dflash.run.config import DFlashFile, config_hash
from dflash.run.options import (
    DrafterStageOptions,
    EvaluatorOptions,
    MonitorOptions,
    PostprocessOptions,
    PrefetchOptions,
    TargetStageOptions,
)
from dflash.train.loss import needs_final_hidden, uses_head

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["Resolved", "drafter_replicas", "load_and_resolve", "resolve", "resolve_drafter", "target_hf_config"]

DRAFTER_KIND = "dflash.drafter"


class Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """The checked run configuration (frozen; built by :func:`resolve`).

    Attributes:
        cfg: the filled graph file: what ``RUN_DIR/config.toml``, the checkpoints'
            ``train_config.json`` and :attr:`config_hash` are made from.
        drafter: the drafter config resolved against the target (every dimension set).
        config_hash: :func:`dflash.run.config.config_hash` of ``cfg``.
        prefetch, target, postprocess, trainer, monitor, evaluator: the options of the stage kinds
            ``dflash.prefetch``, ``dflash.target``, ``dflash.postprocess``, ``dflash.drafter``,
            ``dflash.monitor`` and ``dflash.evaluator``.
    """

    cfg: DFlashFile
    drafter: DrafterConfig
    config_hash: str
    prefetch: PrefetchOptions
    target: TargetStageOptions
    postprocess: PostprocessOptions
    trainer: DrafterStageOptions
    monitor: MonitorOptions
    evaluator: EvaluatorOptions


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


def drafter_replicas(cfg: DFlashFile) -> int:
    """Replicas of the ``dflash.drafter`` process (data-parallel drafters; 1 when there is none)."""
    return next((p.replicas for p in cfg.process if p.kind == DRAFTER_KIND), 1)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a ConfigError is printed as one)."""
    return " ".join(str(exc).split())


def _wandb_config(cfg: DFlashFile, drafter: DrafterConfig, digest: str) -> dict[str, Any]:
    """What the wandb run records as its config: the filled graph file, plus what it leaves
    implicit and a team comparing runs needs to see: the target layers the drafter reads, the
    drafter variant and block size, the config hash, and the data file's identity (path, size,
    mtime; none when the source cannot be found yet, which the data step then reports)."""
    try:
        _, data = resolve_source(cfg.data.source)
    except dflash.data.DataError:
        data = None
    resolved = {"target_layer_ids": drafter.target_layer_ids, "drafter_variant": drafter.variant,
                "block_size": drafter.block_size, "config_hash": digest, "data": data}
    return {**msgspec.to_builtins(cfg), "resolved": resolved}


def target_hf_config(target: TargetConfig) -> PretrainedConfig:
    """The target's transformers config (``config.json`` of ``target.path``, or a preset), with
    ``target.overrides`` applied; the weights are never read.

    Raises:
        ConfigError: ``target.path`` missing or without ``config.json``, an unreadable
            ``config.json``, or an unknown ``target.overrides`` key (one line naming the key).
    """
    try:
        return build_hf_config(target)
    except (OSError, ValueError) as exc:  # FileNotFoundError, bad overrides, unreadable config.json
        raise ConfigError(one_line(exc)) from None


def resolve_drafter(cfg: DFlashFile, hf: PretrainedConfig) -> DrafterConfig:
    """``[drafter]`` with every dimension taken from the target and the captured layers chosen
    (``target.layer_ids``, or the public rule: evenly spaced from 1 to N-3).

    Raises:
        ConfigError: ``target.layer_ids`` out of range or naming the last layer, a target too
            shallow for ``drafter.num_layers`` default layers, a ``drafter.hidden_size`` unlike the
            target's, or drafter heads that do not divide.
    """
    try:
        layer_ids = resolve_layer_ids(cfg.target, hf, cfg.drafter.num_layers)
        check_not_last_layer(layer_ids, hf.num_hidden_layers)
        drafter = cfg.drafter.resolve(hf, layer_ids)
        drafter.check_resolved()
    except ValueError as exc:
        raise ConfigError(one_line(exc)) from None
    return drafter


def load_and_resolve(cfg: DFlashFile) -> tuple[Resolved, PreTrainedTokenizerBase]:
    """Read the target's config, then its tokenizer (no data), and :func:`resolve` ``cfg`` with them.

    The config is read first, so a wrong ``target.path`` is named as that key rather than as a
    tokenizer that cannot be found there.

    Returns:
        ``(resolved, tokenizer)``: the tokenizer is the data path's (:func:`dflash.data.load_tokenizer`).

    Raises:
        ConfigError: :func:`target_hf_config` or :func:`resolve` refused the file.
        dflash.data.DataError: the tokenizer cannot be loaded.
    """
    hf = target_hf_config(cfg.target)
    tok = dflash.data.load_tokenizer(cfg.target.tokenizer_source)  # looked up at call time: tests replace them
    return resolve(cfg, dflash.data.tokenizer_info(tok), hf), tok


def resolve(cfg: DFlashFile, tokenizer: TokenizerInfo, hf: PretrainedConfig | None = None) -> Resolved:
    """Fill ``cfg`` from ``tokenizer``, resolve the drafter against the target and build every
    stage's options.

    Args:
        cfg: a graph file from :func:`dflash.run.config.load_config` (not changed).
        tokenizer: the target tokenizer's vocabulary size and special ids
            (:func:`dflash.data.tokenizer_info`).
        hf: the target's transformers config (:func:`target_hf_config` of ``cfg.target``; read
            here when None). Not changed: the filled vocabulary size goes into a copy.

    Returns:
        the :class:`Resolved` run configuration.

    Raises:
        ConfigError: the target's config cannot be read, the drafter cannot be resolved against
            it, or a mask token is missing (one line naming the key path to change).
    """
    full = filled(cfg, tokenizer)
    if hf is None:
        hf = target_hf_config(full.target)
    elif full.target.vocab_size is not None and full.target.vocab_size != hf.vocab_size:
        hf = copy.copy(hf)
        hf.vocab_size = full.target.vocab_size
    drafter = resolve_drafter(full, hf)
    run, train = full.run, full.train
    features = FeaturePostprocess(noise=train.feature_noise, seed=run.seed, side=train.postprocess_side)
    digest = config_hash(full)
    return Resolved(
        cfg=full,
        drafter=drafter,
        config_hash=digest,
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
                                    keep_last=full.checkpoint.keep_last, keep_best=full.checkpoint.keep_best,
                                    config_hash=digest, train_config=full,
                                    eval_every=full.eval.every, time_budget_s=run.time_budget_s),
        monitor=MonitorOptions(window=full.monitor.window, wandb=full.monitor.wandb,
                               wandb_project=full.monitor.wandb_project, display=full.monitor.display,
                               spike_k=full.monitor.spike_k, run_name=run.name, total_steps=run.steps,
                               wandb_config=_wandb_config(full, drafter, digest)),
        evaluator=EvaluatorOptions(drafter=drafter, target=full.target, data=full.data, eval=full.eval),
    )
