"""Prompts built exactly as training builds contexts: for ``python -m dflash.eval``, the decode
benchmark and any other real decode of a trained drafter.

A prompt is the tokens :class:`~dflash.data.ChatEncoder` (with a run's ``[data]`` settings) puts
before an assistant turn's first trained token, chat template included. So the thinking mode
matches training: with a Qwen3 template a turn without reasoning opens
``assistant\n<think>\n\n</think>\n\n`` (the non-thinking generation prompt) in both, and a trained
reasoning turn opens ``assistant\n<think>\n``. A conversation that opens with an assistant turn has
no prompt and is skipped.

* :func:`heldout_prompts`: a training run's held-out conversations
  (``dataset.split(data.holdout, data.seed)[1]``, the part dflash.run does not train on);
* :func:`source_prompts`: the last usable conversations of a source (file order);
* :func:`encode_prompt`: the prompt for a reply to given messages.
"""

from __future__ import annotations

from dflash.data.chat import ChatEncoder
from dflash.data.config import DataConfig, DataError
from dflash.data.sources import read_source
from dflash.data.tokenize import encoder_kwargs, load_dataset

__all__ = ["encode_prompt", "heldout_prompts", "source_prompts", "usable_prompts"]


_PLACEHOLDER = {"role": "assistant", "content": "x"}


def _prompt_encoder(tok, data_cfg: DataConfig | None = None, **override):
    """The training encoder of ``data_cfg`` (default ``DataConfig()``), without a length limit."""
    kwargs = {**encoder_kwargs(data_cfg or DataConfig()), "max_length": 1 << 40, "min_loss_tokens": 0}
    return ChatEncoder(tok, **{**kwargs, **override})


def _context(encoder, conv: list[dict]) -> list[int]:
    ids = encoder.context(conv)
    if isinstance(ids, str):
        raise DataError(f"cannot build an eval prompt with this tokenizer's chat template ({ids}): "
                        f"{[m['role'] for m in conv]}")
    return ids.tolist()


def _min_prompt_tokens(tok, data_cfg: DataConfig | None = None) -> int:
    """Tokens of the shortest real prompt: a one-character user turn and the header of the
    assistant turn after it, as training renders it (first turn of two, or the only turn: a
    Qwen3 template heads them differently). A tokenized training prompt shorter than this holds
    no user text (the conversation opened with an assistant turn), so eval skips it."""
    enc = _prompt_encoder(tok, data_cfg, last_turn_only=False)
    user = {"role": "user", "content": "x"}
    return min(len(_context(enc, [user, _PLACEHOLDER])),
               len(_context(enc, [user, _PLACEHOLDER, user, _PLACEHOLDER])))


def heldout_prompts(data_cfg: DataConfig, tok, num: int, max_tokens: int, turn: str = "first") -> list[list[int]]:
    """Prompt ids of the first ``num`` usable held-out conversations of a training run.

    Loads the run's tokenized data (``load_dataset``: a cache hit when run from the training
    run's directory or with the same ``$DFLASH_CACHE``, else it tokenizes ``data.source`` again),
    takes ``dataset.split(data.holdout, data.seed)[1]`` (exactly the conversations dflash.run did
    not train on) and each one's :meth:`~dflash.data.TokenizedDataset.prompt` (the context before
    its first trained token, chat template included), cut to its last ``max_tokens`` tokens; with
    ``turn="last"`` the context before its *last* trained turn instead
    (:meth:`~dflash.data.TokenizedDataset.last_prompt`: the whole conversation so far, or with
    ``data.join`` many conversations deep). Conversations without user text before the first
    assistant turn are skipped.
    """
    ds = load_dataset(data_cfg, tok, progress=False, quiet=True)
    _, held = ds.split(data_cfg.holdout, data_cfg.seed)
    return usable_prompts(held, tok, data_cfg, num, max_tokens, turn)


def usable_prompts(held, tok, data_cfg: DataConfig, num: int, max_tokens: int,
                   turn: str = "first") -> list[list[int]]:
    """Prompt ids of the first ``num`` conversations of ``held`` (a :class:`~dflash.data.TokenizedDataset`)
    with user text before their first trained token, each cut to its last ``max_tokens`` tokens;
    ``turn="last"``: the context before each one's last trained turn (:func:`heldout_prompts`
    without loading the data)."""
    shortest = _min_prompt_tokens(tok, data_cfg)
    out = []
    for i in range(len(held)):
        if len(out) == num:
            break
        if len(held.prompt(i)) >= shortest:      # user text before its first answer
            ids = held.last_prompt(i) if turn == "last" else held.prompt(i)
            out.append(ids[-max_tokens:].tolist())
    return out


def source_prompts(source: str, tok, num: int, max_tokens: int,
                   data_cfg: DataConfig | None = None) -> list[list[int]]:
    """Prompt ids of the *last* ``num`` usable conversations of a dflash.data source (file order).

    A conversation's prompt is the context training gives its first trained assistant turn (the
    turns before it, chat template included; ``data_cfg`` gives the training settings, default
    ``DataConfig()``), cut to its last ``max_tokens`` tokens. Conversations with no user turn
    before their first assistant turn are skipped and earlier ones taken instead.

    Raises:
        DataError: unknown source, no usable conversation in it, or a chat template the data path
            cannot split.
    """
    picked = []
    for conv in reversed(read_source(source).conversations):
        first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        if any(m["role"] == "user" for m in conv[:first]):
            picked.append(conv)
        if len(picked) == num:
            break
    enc = _prompt_encoder(tok, data_cfg)
    return [_context(enc, conv)[-max_tokens:] for conv in reversed(picked)]


def encode_prompt(tok, conv: list[dict], max_tokens: int, data_cfg: DataConfig | None = None) -> list[int]:
    """Prompt ids for an assistant reply to ``conv`` (messages ``{"role", "content"}``), cut to
    the last ``max_tokens``: the context training gives an assistant turn that follows ``conv``
    (``data_cfg``: the training settings, default ``DataConfig()``), so the generation prompt and
    its thinking mode are the ones the drafter was trained behind.

    Raises:
        DataError: the chat template cannot be split by the data path.
    """
    enc = _prompt_encoder(tok, data_cfg, last_turn_only=True)  # conv's own turns are all context
    return _context(enc, [*conv, _PLACEHOLDER])[-max_tokens:]
