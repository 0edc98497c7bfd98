"""The DFlash graph file: csp's ``[[channel]]``/``[[process]]``/``[trace]`` plus dflash's own tables.

Every table is a msgspec Struct with unknown keys forbidden, so a typo is reported with its path
(``Object contains unknown field 'lr_peak' - at $.train``) before anything starts. Each component
owns its table: ``[data]`` is :class:`dflash.data.DataConfig`, ``[target]``
:class:`dflash.model.target.TargetConfig`, ``[drafter]`` :class:`dflash.model.drafter_config.DrafterConfig`,
``[loss]`` :class:`dflash.train.loss.LossConfig`, ``[train]`` :class:`dflash.train.config.TrainSection`,
``[checkpoint]`` :class:`dflash.checkpoint.config.CheckpointSection` and ``[monitor]``
:class:`dflash.observe.config.MonitorSection`; this module adds ``[run]`` and assembles the file.

Paths (:data:`PATH_KEYS`): a relative path written in the graph file is relative to the graph
file's own directory (``examples/dflash-tiny.toml`` says ``path = "../dflash/assets/..."`` and
``out_dir = "../runs/{name}"``, so it trains the same from the repository root and from
``examples/``; ``{name}`` is ``run.name``, by default the file's stem); one given with ``--set`` is relative to the current directory. The loaded config
holds each re-spelled for the current directory (:func:`csp.load_spec`), which is what
``RUN_DIR/config.toml`` records. Every path must be usable on this system: no NUL character, no
component over 255 bytes, at most 4,095 bytes in all (one line, exit 2, naming the key).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

import csp
from csp.graph.load import cut
from dflash.checkpoint.config import CheckpointSection
from dflash.data import DataConfig
from dflash.errors import ConfigError
from dflash.eval.config import EVALUATOR_KIND, EvalSection
from dflash.model.drafter import DrafterConfig
from dflash.model.target import TargetConfig
from dflash.model.variants import VARIANT_NAMES, VARIANTS, variant_of
from dflash.observe.config import MonitorSection
from dflash.tables import PositiveInt, Table, added_later, keys_added_later
from dflash.train.config import TrainSection
from dflash.train.loss import LossConfig

MAX_STEPS = 10 ** 8 - 1
"""The most ``run.steps`` may be (99,999,999): checkpoint directories are named ``step_%08d`` and
ordered by name (:func:`dflash.checkpoint.list_checkpoints`), so a ninth digit would sort step
100,000,000 before step 99,999,999 and resume the wrong one. Generous: at one step a second it
is over three years of training."""


class RunSection(Table):
    """``[run]``: what this run is called, where it writes, how long it trains."""

    name: str | None = None
    """The run's name: shown in the terminal, the summary and as the wandb run's name, and what
    ``{name}`` in ``out_dir`` stands for. Default: the graph file's name without ``.toml``, so a copy
    of a graph file is a run of its own."""
    out_dir: str
    """Run directory (a relative path is relative to the graph file's directory; given with
    ``--set``, to the current directory). ``{name}`` in it is replaced by ``run.name``: the shipped
    examples say ``"../runs/{name}"``, so a copy saved under another name writes to its own run
    directory instead of resuming the original's checkpoints."""
    steps: PositiveInt
    """Drafter steps (batches) to train in total, counting steps done before a resume; at most
    :data:`MAX_STEPS` (99,999,999)."""
    seed: int = 0
    """Seeds the data order, anchors, feature noise and drafter init (any value
    ``torch.manual_seed`` takes: -2**63 .. 2**64 - 1)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True); exact resume is bitwise on CPU in this mode."""
    resume: str = "auto"
    """"auto" (newest healthy checkpoint of out_dir, if any), "none", or a checkpoint path
    (relative to the graph file, like out_dir)."""
    time_budget_s: Annotated[Annotated[float, Meta(gt=0.0)] | None, added_later(None, hashed=False)] = None
    """Seconds of training (wall clock from this process's first step; a resume gets a budget of its
    own): the lr schedule's end follows the measured step rate so the cosine ends at the deadline,
    and the run then ends as completed (final checkpoint and evaluation come after it).
    ``run.steps`` stays the most steps trained. Unset: the schedule ends at ``run.steps``. Not under
    torchrun."""

    memory_check: Annotated[bool, added_later(True, hashed=False)] = True
    """Before any work, estimate each CUDA device's peak memory from the settings and stop a run
    that clearly will not fit, naming what would (:mod:`dflash.run.memory`; docs/gpus.md). False
    starts the run anyway (for an estimate that is wrong for your model)."""

    def __post_init__(self) -> None:
        if self.steps > MAX_STEPS:
            raise ValueError(f"run.steps = {cut(str(self.steps))} is above {MAX_STEPS:,}, the most a run trains "
                             "(checkpoint names hold 8 digits of step); give a smaller run.steps")
        # torch.manual_seed's range; beyond it the run died with "Overflow when unpacking long long"
        if not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"run.seed = {cut(str(self.seed))} is out of range: a seed is an integer in "
                             "-2**63 .. 2**64 - 1")


class DFlashFile(csp.GraphSpec):
    """A whole DFlash graph file (``python -m dflash.run GRAPH.toml``)."""

    run: RunSection
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    target: TargetConfig = msgspec.field(default_factory=TargetConfig)
    drafter: DrafterConfig = msgspec.field(default_factory=DrafterConfig)
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    train: TrainSection = msgspec.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    monitor: MonitorSection = msgspec.field(default_factory=MonitorSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)


PATH_KEYS = ("run.out_dir", "run.resume", "target.path", "target.tokenizer", "data.source", "data.cache_dir",
             "train.init_from")
"""The keys that hold paths. Not paths: ``run.resume`` "auto"/"none", ``target.tokenizer``
"builtin:NAME", ``data.source`` "sharegpt" (:func:`is_path`)."""

_NAME_MAX, _PATH_MAX = 255, 4095  # bytes: Linux's (and macOS's) limits for one component, a whole path


def is_path(key: str, value: str) -> bool:
    """Whether the graph file's ``value`` at dotted ``key`` is a path (see :data:`PATH_KEYS`)."""
    if key not in PATH_KEYS:
        return False
    if key == "run.resume":
        return value not in ("auto", "none")
    if key == "target.tokenizer":
        return not value.startswith("builtin:")
    if key == "data.source":
        return value != "sharegpt"
    return True


def check_paths(cfg: DFlashFile) -> None:
    """Raise :class:`ConfigError` (one line naming the key) for a path this system cannot use:
    a NUL character, a component over 255 bytes or a path over 4,095 bytes."""
    for key in PATH_KEYS:
        table, _, field = key.partition(".")
        value = getattr(getattr(cfg, table), field)
        if not isinstance(value, str) or not is_path(key, value):
            continue
        raw = os.fsencode(value)
        longest = max((len(c) for c in raw.split(b"/")), default=0)
        problem = ("contains a NUL character, which no path may hold" if "\0" in value else
                   f"has a path component of {longest} bytes (at most {_NAME_MAX}): give a shorter name"
                   if longest > _NAME_MAX else
                   f"is {len(raw)} bytes long (at most {_PATH_MAX}): give a shorter path"
                   if len(raw) > _PATH_MAX else None)
        if problem:
            raise ConfigError(f"{key} = {cut(value)!r} {problem}")


def load_config(path: str | Path, overrides: list[str] | None = None) -> DFlashFile:
    """Read, override (``--set section.key=value``) and validate a DFlash graph file.

    Relative paths (:data:`PATH_KEYS`) written in the file are relative to the file's directory,
    those given by ``--set`` to the current directory (module docstring).

    Raises:
        ConfigError: missing file, bad TOML, unknown key, wrong type (csp's message, with the
            path), a path no filesystem can open (:func:`check_paths`), or
            ``drafter.num_anchors``, which is ``train.num_anchors`` now.
    """
    try:
        cfg = csp.load_spec(path, spec_type=DFlashFile, overrides=overrides or [], file_paths=is_path)
    except csp.GraphError as exc:
        if _OLD_NUM_ANCHORS in str(exc):
            raise ConfigError(f"{path}: drafter.num_anchors is a training-sampling setting and has moved to "
                              "[train]: rename it to train.num_anchors (--set train.num_anchors=N)") from exc
        if "$.drafter.variant" in str(exc):  # msgspec names the bad value, not the good ones
            raise ConfigError(f"{exc}; drafter.variant is one of {', '.join(VARIANT_NAMES)} "
                              "(dflash.model.variants)") from exc
        raise ConfigError(str(exc)) from exc
    cfg = _named(cfg, Path(path))
    check_paths(cfg)
    return cfg


def _named(cfg: DFlashFile, path: Path) -> DFlashFile:
    """``cfg`` with ``run.name`` set (the graph file's stem when the file gives none) and ``{name}``
    in ``run.out_dir`` replaced by it: what ``RUN_DIR/config.toml`` then records."""
    name = cfg.run.name if cfg.run.name is not None else path.stem
    if "{name}" in cfg.run.out_dir and (name.strip() in ("", ".", "..") or any(c in name for c in "/\\\0")):
        raise ConfigError(f"run.name = {cut(name)!r} cannot name a run directory (run.out_dir = "
                          f"{cut(cfg.run.out_dir)!r}): give a non-empty name without '/', e.g. \"my-run\"")
    run = msgspec.structs.replace(cfg.run, name=name, out_dir=cfg.run.out_dir.replace("{name}", name))
    return msgspec.structs.replace(cfg, run=run)


def tables(spec: type[msgspec.Struct] = DFlashFile) -> dict[str, type[Table]]:
    """``{name: struct}`` of the graph file's own tables (``[target]``, ``[drafter]``, ...)."""
    out = {}
    for field in msgspec.inspect.type_info(spec).fields:
        if isinstance(field.type, msgspec.inspect.StructType) and issubclass(field.type.cls, Table):
            out[field.encode_name] = field.type.cls
    return out


def unread_variant_keys(cfg: DFlashFile) -> list[str]:
    """One warning per key another variant owns (:mod:`dflash.model.variants`) that this file sets
    away from its default: the run's variant never reads it, so it changes nothing."""
    spec = variant_of(cfg.drafter.variant)
    out = []
    for other in VARIANTS:
        if other is spec:
            continue
        for table, keys in (("drafter", other.drafter_fields), ("loss", other.loss_fields)):
            struct = getattr(cfg, table)
            defaults = dict(zip(struct.__struct_fields__, struct.__struct_defaults__))
            for key in keys:
                if not spec.reads(key) and getattr(struct, key) != defaults[key]:
                    out.append(f"{table}.{key} = {getattr(struct, key)!r} is read by drafter.variant = "
                               f"\"{other.name}\" only; this run's variant is \"{spec.name}\", so it changes nothing")
    return out


def added_later_keys(spec: type[msgspec.Struct] = DFlashFile) -> dict[str, dict[str, Any]]:
    """``{table: {key: value before}}`` for every key of the graph file marked as added later
    (:func:`dflash.tables.added_later`): what a resume's change report fills into a saved config
    that predates them (:func:`dflash.checkpoint.config_changes.config_changes`)."""
    return {name: {key: mark.before for key, mark in keys_added_later(table).items()}
            for name, table in tables(spec).items()}


_OLD_NUM_ANCHORS = "unknown field `num_anchors` - at `$.drafter`"


def _drop_none(obj):
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def to_toml(cfg: DFlashFile) -> bytes:
    """The resolved config as TOML (written to RUN_DIR/config.toml; ``None`` fields are left out,
    which is how TOML spells "use the default")."""
    return msgspec.toml.encode(_drop_none(msgspec.to_builtins(cfg)))


def config_hash(cfg: DFlashFile) -> str:
    """Short stable hash of everything that changes what is trained (``[run].resume``/``out_dir`` and
    ``[monitor]`` excluded), stored in checkpoints."""
    raw = msgspec.to_builtins(cfg)
    # A key added after checkpoints existed (marked on its field, dflash.tables.added_later) is
    # hashed only when it differs from the value that does what the code did before it, so a file
    # that leaves it there hashes as it did before the key existed. The speed switches give the
    # same loss to rounding (tested); drafter.precision = "fp8" or train.optimizer = "muon" change
    # what is trained, and being set, they are hashed.
    for name, table in tables(type(cfg)).items():
        for key, mark in keys_added_later(table).items():
            if mark.hashed_when_set and raw[name].get(key) == mark.before:
                raw[name].pop(key, None)
    # Hashed in the older layout, where num_anchors sat in [drafter]: the same
    # settings give the same hash, so older checkpoints resume without a "config differs" warning.
    raw["drafter"]["num_anchors"] = raw["train"].pop("num_anchors")
    # A variant's own keys change nothing an older variant trains: left out of the hash of every
    # variant declared before it (dflash.model.variants), a DFlash run hashes as it did before
    # DFlash2's keys existed, and a DFlash2 run as before XPress's.
    for later in VARIANTS[VARIANT_NAMES.index(cfg.drafter.variant) + 1:]:
        for key in later.drafter_fields:
            raw["drafter"].pop(key, None)
        for key in later.loss_fields:
            raw["loss"].pop(key, None)
    raw["run"] = {k: v for k, v in raw["run"].items() if k not in ("resume", "out_dir", "steps", "time_budget_s", "memory_check")}
    # A left-out data.holdout (64, at most a tenth of the data) hashes as the 64 it was before it
    # could be left out: the same split wherever the data holds 640 conversations or more; on a
    # smaller set the sampler's dataset fingerprint still refuses a resume across the change.
    if raw["data"].get("holdout") is None:
        raw["data"]["holdout"] = 64
    raw.pop("monitor", None)
    # The in-training evaluation observes the drafter, it changes nothing trained: its table, its
    # process, the channel feeding it and the drafter's port to that channel are left out.
    raw.pop("eval", None)
    taps = {c for p in raw.get("process", []) if p.get("kind") == EVALUATOR_KIND for c in (p.get("inputs") or {}).values()}
    raw["process"] = [p for p in raw.get("process", []) if p.get("kind") != EVALUATOR_KIND]
    for p in raw["process"]:
        if p.get("outputs"):
            p["outputs"] = {k: v for k, v in p["outputs"].items() if v not in taps}
    raw["channel"] = [c for c in raw.get("channel", []) if c.get("name") not in taps]
    raw.pop("trace", None)
    raw.pop("runtime", None)  # supervision only (the deadlock timeout): not what is trained
    raw["checkpoint"].pop("keep_best", None)  # which files stay on disk, not what is trained
    return hashlib.sha256(msgspec.json.encode(raw, order="sorted")).hexdigest()[:16]
