"""What an export says about itself: the target it was trained for and, when recorded, its measured tau.

:func:`describe` reads it from the checkpoint directory:

* the target from ``target_config.json`` (the ``[target]`` table as the run recorded it: a local
  directory's path, relative to where training started, or a preset) and that directory's
  ``config.json`` when it is found from here (:func:`dflash.checkpoint.model_files.locate_target`),
  else the preset's shape: ``model_type``, ``architectures``, layers, hidden size and vocabulary;
* the measured tau when the checkpoint is ``RUN_DIR/checkpoints/step_N`` and the run's
  ``metrics.jsonl`` holds a ``heldout`` record of step N: the in-training evaluator's greedy
  draft-and-verify decode of the run's first held-out conversations with these very weights (the
  last such record, should a resumed run have measured the step again). None otherwise: a tau of
  another step's weights is not this drafter's.

:mod:`dflash.export.write` puts both in ``config.json`` (``dflash_target``, ``dflash_eval``; keys
the public loaders ignore) and in the model card.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from dflash.checkpoint.model_files import locate_target
from dflash.model.drafter import DrafterConfig
from dflash.model.target import TargetConfig

__all__ = ["ExportInfo", "MeasuredTau", "TargetInfo", "describe"]


class TargetInfo(msgspec.Struct, kw_only=True):
    """The target a drafter was trained against (``config.json`` key ``dflash_target``).

    Attributes:
        name_or_path: ``[target].path`` as the run recorded it (relative to the directory training
            started in), or ``preset:NAME`` for a random-init preset shape.
        model_type, architectures: the target's transformers ``model_type`` and model classes
            (None when its directory is not found from here).
        num_hidden_layers, hidden_size, vocab_size: its shape (the drafter's ``vocab_size`` and
            ``num_target_layers`` where the directory is not found).
        found_at: where its directory was found when exporting (None: not found, or a preset);
            the model card's code loads it from there.
    """

    name_or_path: str
    model_type: str | None = None
    architectures: list[str] | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    found_at: str | None = None


class MeasuredTau(msgspec.Struct, kw_only=True):
    """The measured tau recorded with the checkpoint (``config.json`` key ``dflash_eval``).

    Attributes:
        tau: tokens per verify step (accepted + 1), pooled over every verify step; ``accepted``
            = ``tau - 1``.
        step: the training step whose weights were measured (the exported ones).
        prompts: prompts decoded; ``max_new_tokens``: tokens generated per prompt (None in
            records older than it); ``verify_steps``: verify steps in all.
        prompt_source: which prompts, in words (the run's first N held-out conversations of its
            ``data.source``).
        decoder: how they were decoded, in words (greedy draft-and-verify, block size, dtype).
        sampled_tau, temperature: the sampled decode's tau at that temperature (None: greedy only).
        loop_share, fresh_tau: the greedy decodes' share of tokens in repetition loops and the tau
            outside them (:class:`dflash.messages.HeldoutTau`; None in records older than them).
    """

    tau: float
    accepted: float
    step: int
    prompts: int
    max_new_tokens: int | None
    verify_steps: int | None
    prompt_source: str
    decoder: str
    sampled_tau: float | None = None
    temperature: float | None = None
    loop_share: float | None = None
    fresh_tau: float | None = None


class ExportInfo(msgspec.Struct, kw_only=True):
    """What :func:`describe` found: the target, and the measured tau (None when not recorded)."""

    target: TargetInfo
    measured: MeasuredTau | None = None


def describe(checkpoint: str | Path, dc: DrafterConfig, tc: TargetConfig) -> ExportInfo:
    """The target and the recorded tau of the drafter in ``checkpoint`` (the module docstring says
    where each comes from). Never raises for a missing or unreadable run file: what cannot be
    read is left out (None)."""
    return ExportInfo(target=_target(checkpoint, dc, tc), measured=_measured(Path(checkpoint), dc))


def _target(checkpoint: str | Path, dc: DrafterConfig, tc: TargetConfig) -> TargetInfo:
    if tc.path is None:  # a preset: its shape is the preset's, its class what transformers builds for it
        from dflash.model.target_config import PRESETS

        shape = PRESETS[tc.preset]
        return TargetInfo(name_or_path=f"preset:{tc.preset}", model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                          num_hidden_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
                          vocab_size=dc.vocab_size)
    info = TargetInfo(name_or_path=tc.path, num_hidden_layers=dc.num_target_layers, vocab_size=dc.vocab_size)
    found = Path(locate_target(tc, checkpoint).path)
    hf = _read_json(found / "config.json")
    if hf is None:
        return info
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf  # multimodal configs nest it
    return msgspec.structs.replace(
        info, found_at=str(found.resolve()), model_type=hf.get("model_type"), architectures=hf.get("architectures"),
        num_hidden_layers=text.get("num_hidden_layers", info.num_hidden_layers), hidden_size=text.get("hidden_size"),
        vocab_size=dc.vocab_size)


def _measured(checkpoint: Path, dc: DrafterConfig) -> MeasuredTau | None:
    """The last ``heldout`` record of the checkpoint's own step in its run's metrics.jsonl."""
    from dflash.checkpoint import read_meta
    from dflash.records import HeldoutRecord, read_records

    ckpt = checkpoint.resolve()
    run_dir = ckpt.parent.parent
    if ckpt.parent.name != "checkpoints" or not (run_dir / "metrics.jsonl").is_file():
        return None
    step = (read_meta(ckpt) or {}).get("step")
    try:
        records, _ = read_records(run_dir / "metrics.jsonl")
    except OSError:
        return None
    held = [r for r in records if isinstance(r, HeldoutRecord) and r.step == step and isinstance(r.tau, (int, float))]
    if not held:
        return None
    h = held[-1]
    source = _data_source(checkpoint)
    tokens = h.max_new_tokens if isinstance(h.max_new_tokens, int) else None
    if tokens is None and isinstance(h.new_tokens, int) and isinstance(h.prompts, int) and h.prompts:
        tokens = h.new_tokens // h.prompts  # every decode generates exactly max_new_tokens
    dtype = f", {h.dtype}" if isinstance(h.dtype, str) else ""
    temperature = h.temperature if isinstance(h.temperature, (int, float)) and h.temperature > 0 else None
    return MeasuredTau(
        tau=h.tau, accepted=h.accepted if isinstance(h.accepted, (int, float)) else h.tau - 1, step=h.step,
        prompts=h.prompts if isinstance(h.prompts, int) else 0, max_new_tokens=tokens,
        verify_steps=h.steps if isinstance(h.steps, int) else None,
        prompt_source=(f"the run's first {h.prompts} held-out conversations of {source} (never trained on)"
                       if source else f"the run's first {h.prompts} held-out conversations"),
        decoder=f"greedy draft-and-verify against the target at block size {dc.block_size}{dtype} "
                "(dflash.evaluator, during training)",
        sampled_tau=h.sampled_tau if isinstance(h.sampled_tau, (int, float)) else None, temperature=temperature,
        loop_share=h.loop_share if isinstance(h.loop_share, (int, float)) else None,
        fresh_tau=h.fresh_tau if isinstance(h.fresh_tau, (int, float)) else None)


def _data_source(checkpoint: Path) -> str | None:
    from dflash.eval.inputs import EvalInputError, run_data_config

    try:
        data = run_data_config(checkpoint)
    except EvalInputError:
        return None
    return data.source if data is not None else None


def _read_json(path: Path) -> dict[str, Any] | None:
    import json

    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
