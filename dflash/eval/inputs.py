"""What ``python -m dflash.eval`` reads from its command line, checked before any model loads:
the checkpoint directory (:func:`check_checkpoint`, also used by ``dflash.export``), the device
and the ``[data]`` and ``[eval]`` tables of the run that wrote the checkpoint (which say whose
held-out conversations to decode, and how many tokens the run's own evaluator decoded).

Each bad input raises :class:`EvalInputError` with a one-line message saying what to change; the
CLI prints it and exits 2. The ``--prompts`` sets and files are read by :mod:`dflash.eval.sets`;
the prompts themselves are built by :mod:`dflash.data.prompts`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

__all__ = ["EvalInputError", "check_checkpoint", "check_device", "run_data_config", "run_eval_config"]


class EvalInputError(ValueError):
    """Bad CLI input (checkpoint path, device, prompt source); the message says what to change."""


def run_data_config(checkpoint: Path):
    """The ``[data]`` table of the run that wrote ``checkpoint``, or None.

    A checkpoint of ``python -m dflash.run`` lives at ``RUN_DIR/checkpoints/step_N`` and the run
    writes its resolved graph file to ``RUN_DIR/config.toml``; only its ``[data]`` table is read.

    Raises:
        EvalInputError: ``config.toml`` exists but is not readable TOML (an integer of more than
            4,300 digits included) or its ``[data]`` table does not decode.
    """
    from dflash.data import DataConfig

    return _run_table(checkpoint, "data", DataConfig)


def run_eval_config(checkpoint: Path):
    """The ``[eval]`` table (:class:`~dflash.eval.config.EvalSection`) of the run that wrote
    ``checkpoint``, or None when it is not in a run directory (as :func:`run_data_config`); a
    config.toml without the table gives the defaults.

    Raises:
        EvalInputError: ``config.toml`` is not readable TOML or its ``[eval]`` table does not decode.
    """
    from dflash.eval.config import EvalSection

    return _run_table(checkpoint, "eval", EvalSection)


def _run_table(checkpoint: Path, table: str, kind: type):
    from csp.errors import GraphError
    from csp.graph.load import read_toml

    ckpt = Path(checkpoint).resolve()
    path = ckpt.parent.parent / "config.toml"
    if ckpt.parent.name != "checkpoints" or not path.is_file():
        return None
    try:
        return msgspec.convert(read_toml(path).get(table, {}), kind)
    except GraphError as exc:  # not TOML, an integer too long for Python, not UTF-8: names the file
        raise EvalInputError(str(exc)) from None
    except msgspec.ValidationError as exc:
        raise EvalInputError(f"{path}: cannot read its [{table}] table: {exc}") from None


def check_device(name: str):
    """``name`` as a ``torch.device`` this machine has.

    Raises:
        EvalInputError: not a torch device name, or a CUDA device this machine lacks.
    """
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalInputError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise EvalInputError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s); use --device cpu")
    return device


def check_checkpoint(path: str, allow_unhealthy: bool = False) -> Path:
    """``path`` as a drafter checkpoint directory whose weights can be trusted.

    The health rule is :func:`dflash.checkpoint.health.reader_problem` (``healthy: false`` in
    ``meta.json``, or NaN/Inf weights), the same for ``dflash.eval`` and ``dflash.export``. With
    ``allow_unhealthy`` such a checkpoint is accepted after one loud ``WARNING`` line on stderr.

    Raises:
        EvalInputError: missing, not a directory, a run directory (naming its newest complete,
            healthy checkpoint, or saying it has none), lacking checkpoint files or ``meta.json``, or
            unhealthy (naming why and the nearest healthy checkpoint) without ``allow_unhealthy``.
    """
    from dflash.checkpoint import META
    from dflash.checkpoint.model_files import DRAFTER_CONFIG, TARGET_CONFIG, WEIGHTS

    p = Path(path)
    if not p.exists():
        raise EvalInputError(f"{path}: no such checkpoint directory")
    if not p.is_dir():
        raise EvalInputError(f"{path}: not a directory; give a checkpoint directory "
                             "(RUN_DIR/checkpoints/step_N)")
    from dflash.checkpoint import is_healthy, run_dir_checkpoints

    steps = run_dir_checkpoints(p)
    if steps is not None:
        # the example must be usable: the newest complete, healthy one (as --resume suggests),
        # never an empty or interrupted step_* directory
        usable = next((s for s in reversed(steps) if is_healthy(s)), None)
        if usable is not None:
            raise EvalInputError(f"{path} is a run directory; give one of its checkpoints, e.g. {usable}")
        raise EvalInputError(f"{path} is a run directory and holds no complete, healthy checkpoint "
                             f"(python -m dflash.logs {path} says why); give a checkpoint directory")
    missing = [n for n in (WEIGHTS, DRAFTER_CONFIG, TARGET_CONFIG) if not (p / n).is_file()]
    if missing:
        raise EvalInputError(f"{path} is not a drafter checkpoint: {', '.join(missing)} missing")
    if not (p / META).is_file():  # written last, so its absence means the save never finished
        raise EvalInputError(f"{path} has no {META}: a checkpoint's {META} is written last, after its "
                             "weights, so without it the save did not finish and its health is unknown; "
                             "give a complete checkpoint (python -m dflash.logs RUN_DIR lists them)")
    from dflash.checkpoint.health import nearest_healthy, reader_problem

    problem = reader_problem(p)
    if problem is None:
        return p
    if allow_unhealthy:
        print(f"WARNING: {path} is UNHEALTHY: {problem}; using it anyway (--allow-unhealthy): "
              "its results are not to be trusted", file=sys.stderr, flush=True)
        return p
    near = nearest_healthy(p)
    where = f"nearest healthy checkpoint: {near}" if near is not None else \
        f"no healthy checkpoint beside it in {p.parent}"
    raise EvalInputError(f"{path} is unhealthy: {problem}; {where} (or --allow-unhealthy to read it anyway)")
