"""Which prompts ``python -m dflash.eval`` decodes, and its checks of CLI input.

With ``--data SOURCE`` and a checkpoint ``RUN_DIR/checkpoints/step_N`` whose ``RUN_DIR/config.toml``
names SOURCE as ``data.source``, the prompts are the run's held-out conversations
(:func:`heldout_prompts`: ``dataset.split(data.holdout, data.seed)[1]``, the part dflash.run does
not train on). Otherwise they are the last usable conversations of SOURCE (:func:`source_prompts`).
A conversation that opens with an assistant turn has no prompt and is skipped in both cases.
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


def _min_prompt_tokens(tok) -> int:
    """Tokens of the shortest real prompt: a one-character user turn plus the generation prompt.
    A tokenized training prompt shorter than this holds no user text (the conversation opened
    with an assistant turn), so eval skips it."""
    conv = [{"role": "user", "content": "x"}]
    return len(tok(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"])


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
    shortest = _min_prompt_tokens(tok)
    out = []
    for i in range(len(held)):
        ids = held.prompt(i)
        if len(ids) >= shortest:
            out.append(ids[-max_tokens:].tolist())
        if len(out) == num:
            break
    return out


def source_prompts(source: str, tok, num: int, max_tokens: int) -> list[list[int]]:
    """Prompt ids of the *last* ``num`` usable conversations of a dflash.data source (file order).

    A conversation's prompt is its turns before the first assistant turn (chat template with the
    generation prompt), cut to its last ``max_tokens`` tokens; conversations with no such turn
    (they open with an assistant turn) are skipped and earlier ones taken instead.

    Raises:
        DataError: unknown source or no usable conversation in it.
    """
    from dflash.data.sources import read_source

    picked = []
    for conv in reversed(read_source(source).conversations):
        head = []
        for msg in conv:
            if msg["role"] == "assistant":
                break
            head.append(msg)
        if any(m["role"] == "user" for m in head):
            picked.append(head)
        if len(picked) == num:
            break
    return [encode_prompt(tok, conv, max_tokens) for conv in reversed(picked)]


def encode_prompt(tok, conv: list[dict], max_tokens: int) -> list[int]:
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"][-max_tokens:]


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
        steps = sorted(c.name for c in (p / "checkpoints").glob("step_*"))
        hint = f", e.g. {p / 'checkpoints' / steps[-1]}" if steps else " (it has none yet)"
        raise EvalInputError(f"{path} is a run directory; give one of its checkpoints{hint}")
    missing = [n for n in (WEIGHTS, DRAFTER_CONFIG, TARGET_CONFIG) if not (p / n).is_file()]
    if missing:
        raise EvalInputError(f"{path} is not a drafter checkpoint: {', '.join(missing)} missing")
    return p
