"""Tokenizer loading (offline only) and the facts about a tokenizer the rest of dflash needs.

``load_tokenizer("builtin:tiny")`` returns the committed byte-level BPE in
``dflash/assets/tiny_tokenizer`` (4096 tokens, ChatML template, ``<|mask|>`` mask token; built by
:mod:`dflash.data.build_tiny_tokenizer`). Any other spec is a local directory holding a
transformers tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), e.g. a Qwen3 checkpoint
directory. Nothing is ever downloaded: ``local_files_only=True`` is always passed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dflash.data.config import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TINY_TOKENIZER = "builtin:tiny"
TINY_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer"


class TokenizerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What target/drafter configs need from the tokenizer.

    Attributes:
        vocab_size: number of token ids the tokenizer can emit (``len(tokenizer)``, added tokens
            included). A model's embedding table must have at least this many rows.
        mask_token_id: id of the DFlash block mask token, or None when the tokenizer has none
            (real Qwen3 tokenizers: the drafter config then names one).
        pad_token_id: id written on padding (pad token, else eos, else 0).
        eos_token_id: end-of-turn / end-of-sequence id, or None.
    """

    vocab_size: int
    mask_token_id: int | None
    pad_token_id: int
    eos_token_id: int | None


def load_tokenizer(spec: str) -> Any:
    """Load a fast (``tokenizers``-backed) transformers tokenizer, offline.

    Args:
        spec: ``"builtin:tiny"`` or a local directory with a transformers tokenizer.

    Returns:
        A ``PreTrainedTokenizerFast``-compatible tokenizer with a chat template.

    Raises:
        DataError: ``spec`` is neither; the directory holds no loadable tokenizer; the tokenizer
            is not a fast one or has no chat template.
    """
    from transformers import AutoTokenizer

    path = TINY_TOKENIZER_DIR if spec == TINY_TOKENIZER else Path(spec).expanduser()
    if not path.is_dir():
        raise DataError(
            f"tokenizer {spec!r}: not a local directory (nothing is downloaded); use "
            f"{TINY_TOKENIZER!r} or a directory holding tokenizer.json and tokenizer_config.json"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer {spec!r}: cannot load a tokenizer from {path}: {e}") from e
    check_tokenizer(tok, spec)
    return tok


def check_tokenizer(tok: PreTrainedTokenizerBase, name: str = "tokenizer") -> None:
    """Raise DataError unless ``tok`` is a fast tokenizer with a chat template."""
    if getattr(tok, "backend_tokenizer", None) is None:
        raise DataError(f"{name}: a fast (tokenizers-backed, tokenizer.json) tokenizer is required")
    if not getattr(tok, "chat_template", None):
        raise DataError(f"{name}: the tokenizer has no chat_template; the data path needs one")


def tokenizer_info(tok: PreTrainedTokenizerBase) -> TokenizerInfo:
    """The vocabulary size and special ids of ``tok`` (see :class:`TokenizerInfo`)."""
    pad = tok.pad_token_id
    if pad is None:
        pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    return TokenizerInfo(
        vocab_size=len(tok),
        mask_token_id=tok.mask_token_id,
        pad_token_id=int(pad),
        eos_token_id=tok.eos_token_id,
    )


def special_token_ids(tok: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of every special or added token (the candidates for an end-of-turn marker)."""
    ids = set(tok.all_special_ids)
    ids.update(int(i) for i in tok.backend_tokenizer.get_added_tokens_decoder())
    return frozenset(ids)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """sha256 (hex) of the tokenizer's full definition: vocab, merges, normaliser, pre-tokeniser,
    added tokens, special-token map and chat template. Two tokenizers that tokenize or render
    differently get different fingerprints (used in the cache key)."""
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode())
    h.update(json.dumps(tok.chat_template, sort_keys=True).encode())
    h.update(json.dumps({k: str(v) for k, v in tok.special_tokens_map.items()}, sort_keys=True).encode())
    return h.hexdigest()
