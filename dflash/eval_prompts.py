"""Which prompts ``python -m dflash.eval`` decodes, and its checks of CLI input.

With ``--data SOURCE`` and a checkpoint ``RUN_DIR/checkpoints/step_N`` whose ``RUN_DIR/config.toml``
names SOURCE as ``data.source``, the prompts are the run's held-out conversations
(:func:`heldout_prompts`: ``dataset.split(data.holdout, data.seed)[1]``, the part dflash.run does
not train on). Otherwise they are the last usable conversations of SOURCE (:func:`source_prompts`).
A conversation that opens with an assistant turn has no prompt and is skipped in both cases.

Every prompt is built exactly as training builds contexts: the tokens that
:class:`~dflash.data.ChatEncoder` (with the run's ``[data]`` settings) puts before an assistant
turn's first trained token, chat template included. So the thinking mode matches training: with a
Qwen3 template a turn without reasoning opens ``assistant\n<think>\n\n</think>\n\n`` (the
non-thinking generation prompt) in both, and a trained reasoning turn opens
``assistant\n<think>\n``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

__all__ = ["EvalInputError", "check_checkpoint", "encode_prompt", "heldout_prompts",
           "run_data_config", "source_prompts"]


class EvalInputError(ValueError):
    """Bad CLI input (checkpoint path, prompt source); the message says what to change."""


def run_data_config(checkpoint: Path):
    """The ``[data]`` table of the run that wrote ``checkpoint``, or None.

    A checkpoint of ``python -m dflash.run`` lives at ``RUN_DIR/checkpoints/step_N`` and the run
    writes its resolved graph file to ``RUN_DIR/config.toml``; only its ``[data]`` table is read.

    Raises:
        EvalInputError: ``config.toml`` exists but its ``[data]`` table does not decode.
    """
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    from dflash.data import DataConfig

    ckpt = Path(checkpoint).resolve()
    path = ckpt.parent.parent / "config.toml"
    if ckpt.parent.name != "checkpoints" or not path.is_file():
        return None
    try:
        return msgspec.convert(tomllib.loads(path.read_text()).get("data", {}), DataConfig)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise EvalInputError(f"{path}: cannot read its [data] table: {exc}") from None


_PLACEHOLDER = {"role": "assistant", "content": "x"}


def _prompt_encoder(tok, data_cfg=None, **override):
    """The training encoder of ``data_cfg`` (default ``DataConfig()``), without a length limit."""
    from dflash.data import ChatEncoder, DataConfig
    from dflash.data.tokenize import encoder_kwargs

    kwargs = {**encoder_kwargs(data_cfg or DataConfig()), "max_length": 1 << 40, "min_loss_tokens": 0}
    return ChatEncoder(tok, **{**kwargs, **override})


def _context(encoder, conv: list[dict]) -> list[int]:
    from dflash.data import DataError

    ids = encoder.context(conv)
    if isinstance(ids, str):
        raise DataError(f"cannot build an eval prompt with this tokenizer's chat template ({ids}): "
                        f"{[m['role'] for m in conv]}")
    return ids.tolist()


def _min_prompt_tokens(tok, data_cfg=None) -> int:
    """Tokens of the shortest real prompt: a one-character user turn and the header of the
    assistant turn after it, as training renders it (first turn of two, or the only turn: a
    Qwen3 template heads them differently). A tokenized training prompt shorter than this holds
    no user text (the conversation opened with an assistant turn), so eval skips it."""
    enc = _prompt_encoder(tok, data_cfg, last_turn_only=False)
    user = {"role": "user", "content": "x"}
    return min(len(_context(enc, [user, _PLACEHOLDER])),
               len(_context(enc, [user, _PLACEHOLDER, user, _PLACEHOLDER])))


def heldout_prompts(data_cfg, tok, num: int, max_tokens: int) -> list[list[int]]:
    """Prompt ids of the first ``num`` usable held-out conversations of a training run.

    Loads the run's tokenized data (``load_dataset``: a cache hit when run from the training
    run's directory or with the same ``$DFLASH_CACHE``, else it tokenizes ``data.source`` again),
    takes ``dataset.split(data.holdout, data.seed)[1]`` (exactly the conversations dflash.run did
    not train on) and each one's :meth:`~dflash.data.TokenizedDataset.prompt` (the context before
    its first trained token, chat template included), cut to its last ``max_tokens`` tokens.
    Conversations without user text before the first assistant turn are skipped.
    """
    from dflash.data import load_dataset

    ds = load_dataset(data_cfg, tok, progress=False, quiet=True)
    _, held = ds.split(data_cfg.holdout, data_cfg.seed)
    shortest = _min_prompt_tokens(tok, data_cfg)
    out = []
    for i in range(len(held)):
        ids = held.prompt(i)
        if len(ids) >= shortest:
            out.append(ids[-max_tokens:].tolist())
        if len(out) == num:
            break
    return out


def source_prompts(source: str, tok, num: int, max_tokens: int, data_cfg=None) -> list[list[int]]:
    """Prompt ids of the *last* ``num`` usable conversations of a dflash.data source (file order).

    A conversation's prompt is the context training gives its first trained assistant turn (the
    turns before it, chat template included; ``data_cfg`` gives the training settings, default
    ``DataConfig()``), cut to its last ``max_tokens`` tokens. Conversations with no user turn
    before their first assistant turn are skipped and earlier ones taken instead.

    Raises:
        DataError: unknown source, no usable conversation in it, or a chat template the data path
            cannot split.
    """
    from dflash.data.sources import read_source

    picked = []
    for conv in reversed(read_source(source).conversations):
        first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        if any(m["role"] == "user" for m in conv[:first]):
            picked.append(conv)
        if len(picked) == num:
            break
    enc = _prompt_encoder(tok, data_cfg)
    return [_context(enc, conv)[-max_tokens:] for conv in reversed(picked)]


def encode_prompt(tok, conv: list[dict], max_tokens: int, data_cfg=None) -> list[int]:
    """Prompt ids for an assistant reply to ``conv`` (messages ``{"role", "content"}``), cut to
    the last ``max_tokens``: the context training gives an assistant turn that follows ``conv``
    (``data_cfg``: the training settings, default ``DataConfig()``), so the generation prompt and
    its thinking mode are the ones the drafter was trained behind.

    Raises:
        DataError: the chat template cannot be split by the data path.
    """
    enc = _prompt_encoder(tok, data_cfg, last_turn_only=True)  # conv's own turns are all context
    return _context(enc, [*conv, _PLACEHOLDER])[-max_tokens:]


def check_checkpoint(path: str) -> Path:
    """``path`` as a drafter checkpoint directory.

    Raises:
        EvalInputError: missing, not a directory, a run directory, or lacking checkpoint files.
    """
    from dflash.model_io import DRAFTER_CONFIG, TARGET_CONFIG, WEIGHTS

    p = Path(path)
    if not p.exists():
        raise EvalInputError(f"{path}: no such checkpoint directory")
    if not p.is_dir():
        raise EvalInputError(f"{path}: not a directory; give a checkpoint directory "
                             "(RUN_DIR/checkpoints/step_N)")
    if (p / "checkpoints").is_dir():
        from dflash.checkpoint import list_checkpoints

        steps = [c.name for c in list_checkpoints(p / "checkpoints")]
        hint = f", e.g. {p / 'checkpoints' / steps[-1]}" if steps else " (it has none yet)"
        raise EvalInputError(f"{path} is a run directory; give one of its checkpoints{hint}")
    missing = [n for n in (WEIGHTS, DRAFTER_CONFIG, TARGET_CONFIG) if not (p / n).is_file()]
    if missing:
        raise EvalInputError(f"{path} is not a drafter checkpoint: {', '.join(missing)} missing")
    return p
