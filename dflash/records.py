"""The records of ``RUN_DIR/metrics.jsonl``: one msgspec tagged union, written and read here.

Each line is one JSON object whose ``"kind"`` names its type:

==========  ====================================================  =================================
kind        written by                                            type
==========  ====================================================  =================================
start       :func:`dflash.run.cli.prepare`, once per process          :class:`StartRecord`
resume      :func:`dflash.run.cli.prepare`, after a resume            :class:`ResumeRecord`
train       the monitor stage, once per fixed window of steps     :class:`TrainRecord`
skip        the monitor stage, once per non-finite (skipped) step :class:`SkipRecord`
heldout     the monitor stage, once per in-training evaluation      :class:`HeldoutRecord`
checkpoint  the checkpoint writer, after each save attempt; the     :class:`CheckpointRecord`
            trainer again (``demoted: true``) when it later marks
            a checkpoint unhealthy
end         :mod:`dflash.run`, when the process ends              :class:`EndRecord`
==========  ====================================================  =================================

The JSON is the one runs have always written: a field a writer did not set is ``UNSET`` and left
out of the line, so a line decodes and re-encodes to itself, and a record read from an older run
tells "absent" (``"accepted_sim" in rec`` is False) from ``null`` (NaN on the writer's side: a float
field reads back as None). Keys this module does not know are ignored on reading (a newer run's
extras), refused on writing (a typo would be lost). Records also answer ``rec["loss"]``,
``rec.get("loss")`` and ``"loss" in rec`` like the dicts they replace, for code that reads a record
without knowing its type (the display, the plot).

Errors: :func:`decode_line` raises :class:`MetricsFormatError` naming the file and line number;
:func:`read_records` collects those messages instead, so a run's reports still read a file whose
last line a crash cut in half.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Union

import msgspec
from msgspec import UNSET, UnsetType

__all__ = ["KINDS", "CheckpointRecord", "EndRecord", "HeldoutRecord", "MetricsFormatError", "Record", "RecordBase",
           "ResumeRecord", "SkipRecord", "StartRecord", "TrainRecord", "decode_line", "encode",
           "over_text", "read_records", "to_record"]

Float = Union[float, None, UnsetType]
"""A float that a writer may have left out, or written as ``null`` (a NaN)."""


class MetricsFormatError(ValueError):
    """A metrics.jsonl line, or a record about to be written, does not match the record types."""


class RecordBase(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Common part of every record: the tag (``kind``, the class's ``__struct_config__.tag``) and a
    read-only mapping view over the fields that are set."""

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag

    def __getitem__(self, key: str) -> Any:
        if key == "kind":
            return self.kind
        value = getattr(self, key, UNSET) if key in self.__struct_fields__ else UNSET
        if value is UNSET:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key == "kind" or (key in self.__struct_fields__ and getattr(self, key) is not UNSET)

    def keys(self) -> Iterator[str]:
        yield "kind"
        yield from (k for k in self.__struct_fields__ if getattr(self, k) is not UNSET)

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((k, self[k]) for k in self.keys())

    def to_dict(self) -> dict[str, Any]:
        """The record as the dict its JSON line decodes to (NaN stays a float here)."""
        return dict(self.items())


Mapping.register(RecordBase)


class StartRecord(RecordBase, tag="start"):
    """A ``dflash.run`` process began: ``step`` it starts from, its lineage and data summary."""

    config_hash: str | UnsetType = UNSET
    step: int | UnsetType = UNSET
    lineage: str | None | UnsetType = UNSET
    data: dict[str, Any] | None | UnsetType = UNSET  # dflash.data.DataSummary.to_dict()
    batching: dict[str, Any] | UnsetType = UNSET  # dflash.data.BatchingStats
    time: float | UnsetType = UNSET  # unix seconds


class ResumeRecord(RecordBase, tag="resume"):
    """The run continues from checkpoint ``path`` at ``step``; ``rejected``: ``[{"path", "reason"}]``
    of the newer checkpoints passed over; ``config_changes``: what differs from its training config."""

    step: int
    path: str | UnsetType = UNSET
    rejected: list[dict[str, Any]] | UnsetType = UNSET
    config_changes: list[str] | UnsetType = UNSET
    time: float | UnsetType = UNSET


class TrainRecord(RecordBase, tag="train"):
    """One fixed window of steps ``(step - window, step]`` (:class:`dflash.observe.metrics_writer.WindowAggregator`).

    Averages are over the ``steps_averaged`` trained steps; NaN (``null``) when every step was skipped.
    ``acc``: accuracy per block position; ``tau_sim``: simulated tokens per verify step (accepted + 1;
    the accepted length itself in logs without ``accepted_sim``); throughputs in tokens per second;
    ``padding_waste``: a fraction. ``spike``: set (True) only when the monitor flagged the loss.
    ``tv`` and ``conf``: the total-variation and confidence loss terms (unweighted, averaged like
    ``ce``), set only when ``[loss].tv_weight`` / ``conf_weight`` is above 0.
    DFlash2 runs add the selector's figures (:mod:`dflash.train.selector_loss`), averaged like the
    others: ``sel_loss``; ``sel_acc``, the walk's accuracy per block position; ``sel_tau`` and
    ``base_tau``, the tokens per verify step (teacher-forced streak + 1) of the walk and of the
    backbone's top-1; ``recall_k`` (label in the top-K); ``oracle_tau``, oracle top-K tokens per
    verify step; ``label_missing``, the window's total of slots whose label missed the top-K.
    XPress runs (:mod:`dflash.train.xpress_loss`) use the same fields for the refiner: ``sel_loss``
    its loss, ``sel_acc`` and ``sel_tau`` those of its drafts after the training's free-running
    passes; ``recall_k`` and ``oracle_tau`` are null (no top-K) and ``label_missing`` is 0.
    """

    step: int
    window: int | UnsetType = UNSET
    steps_averaged: int | UnsetType = UNSET
    loss: Float = UNSET
    ce: Float = UNSET
    kl: Float = UNSET
    tv: Float = UNSET
    conf: Float = UNSET
    acc: list[float | None] | UnsetType = UNSET
    tau_sim: Float = UNSET
    accepted_sim: Float = UNSET
    lr: Float = UNSET
    grad_norm: Float = UNSET
    tok_s: Float = UNSET
    target_tok_s: Float = UNSET
    drafter_tok_s: Float = UNSET
    padding_waste: Float = UNSET
    blocks: int | UnsetType = UNSET
    skipped_total: int | UnsetType = UNSET
    time: float | UnsetType = UNSET
    spike: bool | UnsetType = UNSET
    sel_loss: Float = UNSET
    sel_acc: list[float | None] | UnsetType = UNSET
    sel_tau: Float = UNSET
    base_tau: Float = UNSET
    recall_k: Float = UNSET
    oracle_tau: Float = UNSET
    label_missing: int | UnsetType = UNSET


class SkipRecord(RecordBase, tag="skip"):
    """Step ``step`` was skipped (non-finite): the batch, the target replica that made it, why."""

    step: int
    batch_id: int | UnsetType = UNSET
    replica: int | None | UnsetType = UNSET
    reason: str | None | UnsetType = UNSET
    time: float | UnsetType = UNSET


class HeldoutRecord(RecordBase, tag="heldout"):
    """Measured tau of real draft-and-verify decoding on held-out prompts with the weights of
    ``step`` (``[eval]``; :class:`dflash.messages.HeldoutTau` has the fields' meaning).
    ``max_new_tokens``, ``temperature``, ``dtype``, ``loop_share`` and ``fresh_tau`` are absent from
    runs older than them."""

    step: int
    tau: Float = UNSET
    accepted: Float = UNSET
    sampled_tau: Float = UNSET
    prompts: int | UnsetType = UNSET
    new_tokens: int | UnsetType = UNSET
    steps: int | UnsetType = UNSET
    seconds: Float = UNSET
    skipped: int | UnsetType = UNSET
    time: float | UnsetType = UNSET
    max_new_tokens: int | None | UnsetType = UNSET
    temperature: Float = UNSET
    dtype: str | None | UnsetType = UNSET
    tree_tau: Float = UNSET
    tree_budget: int | None | UnsetType = UNSET
    loop_share: Float = UNSET
    fresh_tau: Float = UNSET

    def over(self) -> str:
        """What its tau is over, ``8 prompts x 64 tokens`` (:func:`over_text`). A record older than
        ``max_new_tokens`` gives ``new_tokens / prompts``: every decode generates exactly
        ``max_new_tokens`` (no stop token ends it)."""
        prompts = self.prompts if isinstance(self.prompts, int) else 0
        tokens = self.max_new_tokens
        if not isinstance(tokens, int):
            tokens = self.new_tokens // prompts if prompts and isinstance(self.new_tokens, int) else None
        return over_text(prompts, tokens)

    def loops_text(self) -> str:
        """``; 18% of tokens in repetition loops, 2.488 outside them`` when the decodes looped (the
        run's log line and its summary say it so), else empty: loops are easy to draft, and the
        tau outside them is the drafter on text that does not repeat itself."""
        share = self.loop_share
        if not isinstance(share, (int, float)) or not share > 0:
            return ""
        fresh = f"{self.fresh_tau:.3f}" if isinstance(self.fresh_tau, (int, float)) else "-"
        return f"; {share:.0%} of tokens in repetition loops, {fresh} outside them"


def over_text(prompts: int, max_new_tokens: int | None, decodes: int | None = None) -> str:
    """What a measured tau is over, in the words the run's log, its summary and ``dflash.eval``
    share: ``8 prompts x 64 tokens`` (``80 prompts, 160 turns x 128 tokens`` when later turns of a
    prompt were decoded too; no ``x`` part when the tokens are unknown)."""
    turns = f", {decodes} turns" if decodes is not None and decodes != prompts else ""
    tokens = f" x {max_new_tokens} tokens" if max_new_tokens is not None else ""
    return f"{prompts} prompt{'' if prompts == 1 else 's'}{turns}{tokens}"


class CheckpointRecord(RecordBase, tag="checkpoint"):
    """A save attempt at ``step``: ``path`` None when nothing was written (non-finite state);
    ``reason`` set when not healthy; ``save_s``: seconds from snapshot to rename.

    ``demoted: true`` marks a later record for a checkpoint already recorded healthy, written when
    it is marked unhealthy after the fact (``healthy: false`` and the ``reason``; no ``save_s``).
    For a step, the last checkpoint record is the one that holds, as ``meta.json`` does (which
    ``python -m dflash.logs`` and resume read).
    """

    step: int
    path: str | None | UnsetType = UNSET
    healthy: bool | UnsetType = UNSET
    reason: str | None | UnsetType = UNSET
    save_s: Float = UNSET
    demoted: bool | UnsetType = UNSET
    time: float | UnsetType = UNSET


class EndRecord(RecordBase, tag="end"):
    """The process ended with ``status`` and ``exit_code`` after ``seconds``; ``rank`` under torchrun.
    ``step``: the drafter's last finished step (the trainer's own count: ``train`` windows still in
    flight at an abort or a failure are never written); ``unevaluated``: the newest step whose
    held-out evaluation a stop cut short or never started (:class:`dflash.run.app.RunProgress`);
    ``estimated_gib`` and ``peak_gib``: per CUDA device, the memory estimated before the run
    (:mod:`dflash.run.memory`) and the most this process allocated (``torch.cuda.max_memory_allocated``),
    GiB."""

    status: str | UnsetType = UNSET
    exit_code: int | UnsetType = UNSET
    rank: int | UnsetType = UNSET
    seconds: Float = UNSET
    step: int | UnsetType = UNSET
    unevaluated: int | None | UnsetType = UNSET
    estimated_gib: dict[str, float] | UnsetType = UNSET
    peak_gib: dict[str, float] | UnsetType = UNSET
    time: float | UnsetType = UNSET


Record = Union[StartRecord, ResumeRecord, TrainRecord, SkipRecord, HeldoutRecord, CheckpointRecord, EndRecord]
"""Any metrics.jsonl record (msgspec picks the type by ``kind``)."""

KINDS: dict[str, type[RecordBase]] = {t.__struct_config__.tag: t for t in Record.__args__}

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def to_record(record: RecordBase | Mapping[str, Any]) -> RecordBase:
    """``record`` as its typed record; a dict (the writers' older API) is converted by its ``kind``.

    Raises:
        MetricsFormatError: no or an unknown ``kind``, a key the kind does not have, or a value of
            the wrong type (the message names the kind and the key).
    """
    if isinstance(record, RecordBase):
        return record
    kind = record.get("kind")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MetricsFormatError(f"metrics record kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    unknown = [k for k in record if k != "kind" and k not in cls.__struct_fields__]
    if unknown:
        raise MetricsFormatError(f"{kind} record has no field {', '.join(map(repr, unknown))}; "
                                 f"its fields: {', '.join(cls.__struct_fields__)}")
    try:
        return msgspec.convert(dict(record), Record)
    except msgspec.ValidationError as exc:
        raise MetricsFormatError(f"{kind} record: {exc}") from None


def encode(record: RecordBase | Mapping[str, Any]) -> bytes:
    """One metrics.jsonl line (newline included); sets ``time`` to now when it is unset."""
    rec = to_record(record)
    if "time" in rec.__struct_fields__ and getattr(rec, "time") is UNSET:
        rec.time = time.time()
    return _encoder.encode(rec) + b"\n"


def decode_line(line: str | bytes, path: str | Path = "metrics.jsonl", lineno: int = 0) -> Record:
    """The record of one metrics.jsonl line.

    Raises:
        MetricsFormatError: ``"PATH line N: ..."`` when the line is not JSON (a write cut short),
            not an object, has no or an unknown ``kind``, or a field of the wrong type.
    """
    where = f"{path} line {lineno}"
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if "Invalid value" in msg and "$.kind" in msg:
            kind = msgspec.json.decode(line).get("kind")
            msg = f"unknown record kind {kind!r} (known: {', '.join(KINDS)})"
        raise MetricsFormatError(f"{where}: {msg}") from None
    except msgspec.DecodeError as exc:
        raise MetricsFormatError(f"{where}: not a JSON record ({exc})") from None


def read_records(path: str | Path) -> tuple[list[Record], list[str]]:
    """Every well-formed record of a metrics.jsonl, in file order, and one message (the
    :class:`MetricsFormatError` text, naming file and line) for each line that is not one; blank
    lines are neither.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    records: list[Record] = []
    problems: list[str] = []
    for n, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(decode_line(line, path, n))
        except MetricsFormatError as exc:
            problems.append(str(exc))
    return records, problems
