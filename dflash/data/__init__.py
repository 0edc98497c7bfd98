"""The DFlash data path: conversations -> chat template + assistant loss mask -> cached token
arrays -> batches (sorted / random / bucketed / packed) with a resumable order.

Typical use (what the ``prefetch`` stage does)::

    tok = load_tokenizer("builtin:tiny")              # or a local Qwen3 directory
    data = load_dataset(cfg, tok)                     # tokenizes once, then memory-maps the cache
    train, heldout = data.split(cfg.holdout, cfg.seed)
    sampler = Sampler(train, cfg, pad_id=tokenizer_info(tok).pad_token_id)
    sampler.load_state_dict(saved)                    # optional: resume exactly
    for batch in sampler: ...                         # dflash.messages.Batch, forever

Imports: the leaf modules (:mod:`dflash.errors`, :mod:`dflash.messages`), tokenizers and numpy;
no model, so data can be prepared and tested without torch models. Modules::

    config.py                DataConfig, the [data] table; the data path's error type
    sources.py               conversation sources and file formats (ShareGPT, JSON/JSONL, prompt/completion),
                             with the reasons a conversation is skipped
    tokenizer.py             offline tokenizer loading and TokenizerInfo, the facts dflash needs of it
    chat.py                  a conversation -> token ids + assistant loss mask, through the chat template
    chat_render.py           the chat template's compiled renderer, the forms a template writes a text in
    tokenize.py              load_dataset(): tokenize a source once, in parallel, and cache it
    cache.py                 the on-disk cache entries of tokenized datasets
    dataset.py               TokenizedDataset (flat token arrays, the holdout split) and DataSummary
    batching.py              batching strategies: an epoch's batch plan, and its padding statistics
    sampler.py               Sampler: the endless, resumable stream of batches; collate
    prompts.py               decode prompts built as training builds contexts (not re-exported here)
    build_tiny_tokenizer.py  rebuilds the committed builtin:tiny tokenizer from a slice of ShareGPT
"""

from dflash.data.batching import BatchingStats, PlannedBatch, plan_stats
from dflash.data.chat import ChatEncoder, Encoded
from dflash.data.config import DataConfig, DataError, default_cache_dir
from dflash.data.dataset import DataSummary, TokenizedDataset, print_summary
from dflash.data.sampler import Sampler, collate
from dflash.data.sources import read_source
from dflash.data.tokenize import load_dataset
from dflash.data.tokenizer import (
                                   TINY_TOKENIZER,
                                   TokenizerInfo,
                                   load_tokenizer,
                                   tokenizer_fingerprint,
                                   tokenizer_info,
)

__all__ = [
    "BatchingStats",
    "ChatEncoder",
    "DataConfig",
    "DataError",
    "DataSummary",
    "Encoded",
    "PlannedBatch",
    "Sampler",
    "TINY_TOKENIZER",
    "TokenizedDataset",
    "TokenizerInfo",
    "collate",
    "default_cache_dir",
    "load_dataset",
    "load_tokenizer",
    "plan_stats",
    "print_summary",
    "read_source",
    "tokenizer_fingerprint",
    "tokenizer_info",
]
