"""Every rule of a resolved run, checked once, before any data is read or anything is written.

The third step of the one pass from a graph file to a running graph::

    load_config -> load_and_resolve -> validate -> csp.Graph.from_spec -> (lock, data, resume) -> run

Each rule lives with the room that owns the setting it is about, and :func:`validate` calls each
once, on the resolved config: the data's block fit (:func:`dflash.data.config.check_block_fits`), the
drafter's and the target's kernels against their devices and the installed packages
(:func:`dflash.model.drafter_config.check_drafter_devices`,
:func:`dflash.model.target_config.check_target_devices`), the fused LM head against the loss
(:func:`dflash.train.config.check_train`), the wandb backend
(:func:`dflash.observe.config.check_monitor`), the in-training evaluation against the graph
(:func:`dflash.eval.config.check_eval`), an explicit ``--resume PATH``
(:func:`dflash.checkpoint.check_resume_path`) and the drafter the resumed checkpoint holds
(:func:`dflash.checkpoint.check_architecture`) or, on a fresh start, the one ``[train].init_from``
names (:func:`dflash.checkpoint.init_from.check_init_from`), and each CUDA device's estimated memory
(:func:`dflash.run.memory.check_memory`). The rules about the graph and the run directory
are the run's own and live here. ``python -m dflash.run`` reports the first broken rule as one
line with exit code 2.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dflash.checkpoint import check_architecture, check_optimizer, check_resume_path, resume_candidate
from dflash.checkpoint.config import checkpoint_bytes
from dflash.checkpoint.files import device_of
from dflash.checkpoint.init_from import check_init_from
from dflash.data.config import check_block_fits
from dflash.errors import ConfigError
from dflash.eval.config import EVALUATOR_KIND, check_eval
from dflash.model.drafter_config import DrafterConfig, check_drafter_devices
from dflash.model.target_config import check_target_devices
from dflash.observe.config import check_monitor
from dflash.run.config import DFlashFile, unread_variant_keys
from dflash.run.memory import check_memory
from dflash.run.resolve import DRAFTER_KIND, Resolved, drafter_replicas, one_line, target_hf_config
from dflash.train.config import check_train, lr_warnings

__all__ = ["check_drafter_replicas", "check_run_dir", "check_time_budget", "check_trains_something", "devices_of",
           "disk_space_warnings", "stage_devices", "validate"]

TARGET_KIND = "dflash.target"
MONITOR_KIND = "dflash.monitor"


def validate(resolved: Resolved, *, launched: bool, resume: str) -> list[str]:
    """Check every rule of ``resolved`` once, in the order a user would fix them.

    Args:
        resolved: the output of :func:`dflash.run.resolve.resolve`.
        launched: this process runs under torchrun (:func:`csp.distributed.launched`).
        resume: ``--resume`` or ``[run].resume`` ("auto", "none" or a checkpoint path).

    Returns:
        Warnings (one line each) for settings that are legal but almost certainly unintended: a
        learning rate above 1, a ``train.init_from`` drafter trained on other target layers or
        another mask token, less free disk than the checkpoints kept at once need.

    Raises:
        ConfigError: the first broken rule, one line naming the key to change (among them a
            ``train.init_from`` that does not exist, holds no drafter, or holds one of another
            architecture, checked only when no checkpoint is to be resumed).
        dflash.checkpoint.CheckpointError: ``resume`` names no checkpoint directory, or the
            checkpoint it would continue from holds a drafter of another variant or shape, or was
            trained with another ``[train].optimizer``.
    """
    cfg = resolved.cfg
    check_trains_something(cfg)
    if any(p.kind == MONITOR_KIND for p in cfg.process):
        check_monitor(cfg.monitor)
    check_block_fits(cfg.data)
    check_eval(cfg.eval, evaluators=sum(p.kind == EVALUATOR_KIND for p in cfg.process), holdout=cfg.data.holdout)
    check_drafter_devices(resolved.drafter, devices_of(cfg, DRAFTER_KIND))
    check_train(cfg.train, cfg.loss, resolved.drafter, devices_of(cfg, DRAFTER_KIND))
    check_target_devices(cfg.target, devices_of(cfg, TARGET_KIND))
    check_drafter_replicas(cfg, launched=launched)
    check_time_budget(cfg, launched=launched)
    check_resume_path(resume)
    candidate = resume_candidate(Path(cfg.run.out_dir), resume)
    init_from: list[str] = []
    if candidate is not None:  # a drafter of another shape or variant: refused before any data work
        check_architecture(candidate, resolved.drafter)
        check_optimizer(candidate, cfg.train.optimizer)
    elif cfg.train.init_from is not None:  # a fresh start from another drafter's weights (ignored on resume)
        init_from = check_init_from(cfg.train.init_from, resolved.drafter, run_dir=cfg.run.out_dir)
    check_run_dir(cfg.run.out_dir)
    memory = check_memory(cfg, resolved.drafter, target_hf_config(cfg.target), stage_devices(cfg))
    return (lr_warnings(cfg.train) + unread_variant_keys(cfg) + init_from + memory
            + disk_space_warnings(cfg.run.out_dir, resolved.drafter, cfg.checkpoint.keep_last))


def devices_of(cfg: DFlashFile, kind: str) -> list[str]:
    """Devices the replicas of every ``kind`` process run on ("cpu" where the graph gives none)."""
    out: list[str] = []
    for p in cfg.process:
        if p.kind == kind:
            devs = p.devices if p.devices is not None else [p.device] * p.replicas
            out += [d or "cpu" for d in devs]
    return out


def stage_devices(cfg: DFlashFile) -> dict[str, list[str]]:
    """``{"target": [...], "drafter": [...]}``: the device of every target and drafter replica."""
    return {"target": devices_of(cfg, TARGET_KIND), "drafter": devices_of(cfg, DRAFTER_KIND)}


def check_drafter_replicas(cfg: DFlashFile, *, launched: bool) -> None:
    """Data-parallel drafters (``replicas > 1``) need one torchrun rank each.

    Raises:
        ConfigError: more than one drafter replica and ``launched`` is False (not under torchrun).
    """
    drafters = drafter_replicas(cfg)
    if drafters > 1 and not launched:
        raise ConfigError(
            f"process 'drafter' has replicas = {drafters}: data-parallel drafters need one rank each; "
            f"launch with torchrun --nproc-per-node {drafters} -m dflash.run ... (docs/distributed.md)")


def check_time_budget(cfg: DFlashFile, *, launched: bool) -> None:
    """``[run].time_budget_s`` ends training by telling the prefetch stage, an object shared by the
    stages of one process: under torchrun the stages run in several processes.

    Raises:
        ConfigError: ``run.time_budget_s`` is set and ``launched`` is True.
    """
    if cfg.run.time_budget_s is not None and launched:
        raise ConfigError(f"run.time_budget_s = {cfg.run.time_budget_s:g} works in one process only, not under "
                          "torchrun: leave it out and set run.steps (or stop the run with one SIGTERM)")


def check_trains_something(cfg: DFlashFile) -> None:
    """A DFlash graph trains in its ``dflash.drafter`` process; a file without one (e.g. cut off
    before its ``[[process]]`` tables) would start, train nothing and report success.

    Raises:
        ConfigError: no process of kind ``dflash.drafter``.
    """
    if not any(p.kind == DRAFTER_KIND for p in cfg.process):
        have = ", ".join(sorted({p.kind for p in cfg.process})) or "no [[process]] tables at all"
        raise ConfigError(f"the graph has no process of kind '{DRAFTER_KIND}' ({have}), so nothing would train: "
                          "add the [[channel]] and [[process]] tables of prefetch -> target -> postprocess -> "
                          "drafter -> monitor (examples/dflash-tiny.toml has them)")

def _name_max(path: Path) -> int:
    try:
        return os.pathconf(path, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _nearest_existing(path: Path) -> Path:
    """``path`` (absolute) or its nearest parent that exists (a too-long name counts as missing)."""
    p = Path(os.path.abspath(path))
    while p != p.parent:
        try:
            if p.exists():
                return p
        except OSError:  # ENAMETOOLONG
            pass
        p = p.parent
    return p


def check_run_dir(out_dir: str) -> None:
    """``run.out_dir`` and its ``checkpoints/`` exist as directories or can be created, and can be
    written; checked without creating anything (``dflash.run`` calls it before the run lock and
    any data work).

    Raises:
        ConfigError: one line naming the path and the cause: an empty run.out_dir, a path component longer than the
            filesystem allows (255 bytes), a file where a directory must be, a read-only
            filesystem, or a directory this user cannot write.
    """
    if not out_dir.strip():
        raise ConfigError("run.out_dir is empty; set it to a directory, e.g. runs/my-run")
    shown = out_dir if len(out_dir) <= 120 else f"{out_dir[:60]}...{out_dir[-40:]}"
    key = f"run.out_dir = {shown!r}"
    path = Path(out_dir)
    try:
        existing = _nearest_existing(path)
        limit = _name_max(existing if existing.is_dir() else existing.parent)
        for part in path.parts:
            if len(os.fsencode(part)) > limit:
                short = part if len(part) <= 40 else f"{part[:20]}...{part[-12:]}"
                raise ConfigError(f"{key}: the path component {short!r} is {len(os.fsencode(part))} bytes, "
                                  f"over the filesystem's limit of {limit}; choose a shorter run.out_dir")
        for p in (path, path / "checkpoints"):
            if p.exists() and not p.is_dir():
                raise ConfigError(f"{key}: {p} is a file, not a directory; move it away or choose "
                                  "another run.out_dir")
        if not existing.is_dir():
            raise ConfigError(f"{key}: {existing} is a file, not a directory, so {path} cannot be "
                              "created; choose another run.out_dir")
        for p in (existing, path / "checkpoints"):
            if not p.is_dir():
                continue
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                raise ConfigError(f"{key}: {p} is on a read-only filesystem; choose a writable run.out_dir")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}: {p} is not writable by this user; choose another run.out_dir")
    except (OSError, ValueError) as exc:  # a NUL byte, a name the OS refuses: still one line
        raise ConfigError(f"{key} cannot be used: {one_line(exc)}") from None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_space_warnings(out_dir: str, drafter: DrafterConfig, keep_last: int) -> list[str]:
    """A warning when the filesystem of ``run.out_dir`` has less free space than the checkpoints
    a run keeps at once: ``keep_last`` plus the one being written (:func:`checkpoint_bytes` each).
    Never raises."""
    try:
        existing = _nearest_existing(Path(out_dir))
        free = shutil.disk_usage(existing).free
    except (OSError, ValueError):
        return []
    one = checkpoint_bytes(drafter)
    need = one * (keep_last + 1)
    if free >= need:
        return []
    return [(f"run.out_dir = {out_dir!r}: {device_of(existing)} has {_size(free)} free, short of the "
             f"{_size(need)} that {keep_last + 1} checkpoints of about {_size(one)} need (checkpoint.keep_last = "
             f"{keep_last}, plus the one being written); a full disk stops the run (exit 4)")]
