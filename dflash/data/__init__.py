"""The DFlash data path: conversations -> chat template + assistant loss mask -> cached token
arrays -> batches (sorted / random / bucketed / packed) with a resumable order.

Typical use (what the ``prefetch`` stage does)::

    tok = load_tokenizer("builtin:tiny")              # or a local Qwen3 directory
    data = load_dataset(cfg, tok)                     # tokenizes once, then memory-maps the cache
    train, heldout = data.split(cfg.holdout, cfg.seed)
    sampler = Sampler(train, cfg, pad_id=tokenizer_info(tok).pad_token_id)
    sampler.load_state_dict(saved)                    # optional: resume exactly
    for batch in sampler: ...                         # dflash.messages.Batch, forever

Modules: ``config`` (DataConfig), ``sources`` (file formats, skip reasons), ``tokenizer``
(offline loading, TokenizerInfo), ``chat`` (template rendering + loss mask), ``tokenize``
(parallel tokenization + cache), ``cache`` (on-disk entries), ``dataset`` (TokenizedDataset,
DataSummary), ``batching`` (strategies, statistics), ``sampler`` (Sampler, collate), ``prompts``
(decode prompts built as training builds contexts; not re-exported here). Imports: the leaf
modules (:mod:`dflash.errors`, :mod:`dflash.messages`), tokenizers and numpy; no model, so data
can be prepared and tested without torch models.
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
