"""Tokenize a source once, in parallel, and cache it: ``load_dataset(cfg, tokenizer)``.

The cache key covers everything that changes the arrays: the data file's identity (resolved path,
size, mtime), data.format, the tokenizer fingerprint (vocab, merges, specials, chat template),
max_length, last_turn_only, reasoning, max_samples, the loss-token threshold ``2 * block_size``
and, when set, join and repetition_keep. A second load with the same key memory-maps the stored
arrays and never reads the source file.

Parallelism: conversations are cut into chunks of ``CHUNK``. In this process (``num_workers`` 1,
the default) two threads encode alternate chunks: each chunk's segments go through the Rust
tokenizer's ``encode_batch`` on every core with the GIL released, so one thread's template
rendering and mask assembly overlap the other's tokenization. With ``num_workers > 1`` the
chunks go to that many ``spawn`` processes (no ``fork`` of a process that may hold threads), each
holding its own :class:`~dflash.data.chat.ChatEncoder` and tokenizing on one core. Results are
reassembled in file order, so the arrays depend on neither. Progress counts conversations: a rich
bar in a terminal, a plain line every 2 s (and at the end) in a pipe or log file.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash.data.cache import cache_key, load_entry, save_entry
from dflash.data.chat import ChatEncoder, Encoded
from dflash.data.config import DataConfig
from dflash.data.dataset import DataSummary, TokenizedDataset, print_summary
from dflash.data.sources import (
    SourceRecords,
    no_usable_rows,
    read_source,
    resolve_source,
)
from dflash.data.tokenizer import tokenizer_fingerprint
from dflash.repetition import mask_repetition

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHUNK = 512
"""Conversations per work item (one ``encode_many`` call)."""
THREADS = 2
"""Threads encoding chunks in this process (their ``encode_batch`` calls release the GIL)."""

_ENCODER: ChatEncoder | None = None


def _init_worker(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _ENCODER = ChatEncoder(tokenizer, **kwargs)


def _encode_chunk(job: tuple[int, list]) -> tuple[int, list]:
    index, conversations = job
    assert _ENCODER is not None
    return index, _ENCODER.encode_many(conversations)


class _LineProgress:
    """Progress for a log file or pipe: one plain line at most every ``every_s`` seconds, and one at
    the end (a rich bar in a pipe prints only its final state)."""

    def __init__(self, name: str, total: int, every_s: float = 2.0, stream=None) -> None:
        self.name, self.total, self.every_s = name, total, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            pct = 100.0 * self.done / max(self.total, 1)
            print(f"tokenizing {self.name}: {self.done:,}/{self.total:,} conversations ({pct:.0f}%), "
                  f"{now - self.t0:.1f} s", file=self.stream, flush=True)


@contextmanager
def _progress(name: str, total: int, enabled: bool):
    """``advance(n)`` of a rich bar in a terminal, of plain lines otherwise; a no-op when disabled."""
    if not enabled:
        yield lambda n: None
    elif sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (TextColumn("tokenizing {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True)) as bar:
            task = bar.add_task(name, total=total)
            yield lambda n: bar.advance(task, n)
    else:
        yield _LineProgress(name, total).advance


def encode_all(records: SourceRecords, tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any], workers: int,
                progress: bool) -> list[Encoded | str]:
    convs = records.conversations
    jobs = [(i, convs[s: s + CHUNK]) for i, s in enumerate(range(0, len(convs), CHUNK))]
    results: dict[int, list] = {}
    with _progress(Path(records.name).name, len(convs), progress) as advance:
        if workers <= 1 or len(jobs) <= 1:
            encoder = ChatEncoder(tokenizer, **kwargs)
            # at most THREADS chunks in flight: an error or Ctrl-C waits for those only
            with ThreadPoolExecutor(THREADS, thread_name_prefix="dflash-tokenize") as pool:
                todo = iter(jobs)
                pending = deque((i, len(c), pool.submit(encoder.encode_many, c)) for i, c in islice(todo, THREADS))
                while pending:
                    i, n, future = pending.popleft()
                    results[i] = future.result()
                    advance(n)
                    for j, c in islice(todo, 1):
                        pending.append((j, len(c), pool.submit(encoder.encode_many, c)))
        else:
            ctx = mp.get_context("spawn")
            with ctx.Pool(min(workers, len(jobs)), _init_worker, (tokenizer, kwargs)) as pool:
                for i, encoded in pool.imap_unordered(_encode_chunk, jobs):
                    results[i] = encoded
                    advance(len(encoded))
    return [e for i in range(len(jobs)) for e in results[i]]


def encoder_kwargs(cfg: DataConfig) -> dict[str, Any]:
    """The :class:`~dflash.data.chat.ChatEncoder` arguments training uses for ``cfg`` (eval builds
    its prompts with the same ones)."""
    return {"max_length": cfg.max_length, "last_turn_only": cfg.last_turn_only,
            "min_loss_tokens": 2 * cfg.block_size, "reasoning": cfg.reasoning}


def _key_parts(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[Path, dict[str, Any]]:
    path, identity = resolve_source(cfg.source)
    parts = {
        "source": identity,
        "format": cfg.format,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": cfg.max_length,
        "last_turn_only": cfg.last_turn_only,
        "reasoning": cfg.reasoning,
        "max_samples": cfg.max_samples,
        "min_loss_tokens": 2 * cfg.block_size,
    }
    if cfg.join:  # only when on: entries cached before the setting existed keep their keys
        parts["join"] = True
    if cfg.repetition_keep is not None:  # likewise
        parts["repetition_keep"] = cfg.repetition_keep
    return path, parts


def load_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, progress: bool = True, console=None,
                 quiet: bool = False) -> TokenizedDataset:
    """Tokenized conversations of ``cfg.source`` (from the cache when possible).

    Args:
        cfg: the data config (source, format, max_length, block_size, cache_dir, num_workers...).
        tokenizer: a fast transformers tokenizer with a chat template (see
            :func:`dflash.data.tokenizer.load_tokenizer`).
        progress: show a rich progress bar while tokenizing.
        console: rich Console for the summary (default stderr).
        quiet: do not print the summary (it is still in ``dataset.summary``).

    Returns:
        The whole dataset (use ``dataset.split(cfg.holdout, cfg.seed)`` for train/eval), with
        ``dataset.summary`` (:class:`~dflash.data.dataset.DataSummary`).

    Raises:
        DataError: missing file, or no usable conversation (the message names the file and the
            skip counts per reason).

    With ``num_workers > 1`` the workers are *spawned*: a script calling this at import time of
    its main module needs the usual ``if __name__ == "__main__":`` guard.
    """
    t0 = time.perf_counter()
    path, parts = _key_parts(cfg, tokenizer)
    key = cache_key(parts)
    entry = cfg.resolved_cache_dir() / key
    cached = load_entry(entry)
    if cached is None:
        arrays, summary = _tokenize(cfg, tokenizer, parts, path, entry, progress)
    else:
        arrays, meta = cached
        # cache_path: where it was read from now (a copied or moved cache names its own entry)
        summary = DataSummary(**{**meta["summary"], "from_cache": True, "cache_path": str(entry)})
    summary.seconds = time.perf_counter() - t0
    if not quiet:
        print_summary(summary, console)
    return TokenizedDataset(arrays["tokens"], arrays["loss_mask"], arrays["offsets"],
                            summary=summary, key=key)


def _length_figures(kept: list, lengths: np.ndarray) -> dict[str, int]:
    """The :class:`DataSummary` fields on lengths before truncation: the median cut of a truncated
    conversation, the longest conversation, and the length that keeps ``WHOLE_SHARE`` whole."""
    from dflash.data.dataset import WHOLE_SHARE

    full = np.fromiter((max(e.full_length, len(e.ids)) for e in kept), np.int64, len(kept))
    cut = (full - lengths)[np.fromiter((e.truncated for e in kept), bool, len(kept))]
    whole = int(np.quantile(full, WHOLE_SHARE, method="higher"))
    return {"truncated_cut": int(np.median(cut)) if len(cut) else 0, "longest": int(full.max()),
            "whole_at": -(-whole // 64) * 64}


def join_runs(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Where each joined document starts: consecutive conversations of ``lengths`` (tokens, each at
    most ``max_length``) grouped greedily in order while their sum stays within ``max_length``.
    Returns ``[D + 1]`` int64 indices into the conversations, the last ``len(lengths)``."""
    starts, total = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if total and total + n > max_length:
            starts.append(i)
            total = 0
        total += n
    return np.asarray(starts + [len(lengths)], np.int64)


def _mask_loops(kept: list[tuple[Encoded, int]], cfg: DataConfig,
                skipped: Counter[str]) -> tuple[list[tuple[Encoded, int]], dict[str, int]]:
    """Count the repetition loops of the kept conversations' trained spans and, with
    ``data.repetition_keep`` set, take their tails out of the loss (:mod:`dflash.repetition`).
    A conversation left with fewer than ``2 * block_size`` loss tokens is dropped (``repetition``
    in ``skipped``), as the encoder drops a short one. Returns the conversations kept and the
    :class:`DataSummary` fields."""
    out, spans, loop_tokens, masked = [], 0, 0, 0
    for e, source_index in kept:
        mask, n = mask_repetition(e.ids, e.mask, cfg.repetition_keep)
        if n.masked_tokens and int(mask.sum(dtype=np.int64)) < 2 * cfg.block_size:
            skipped["repetition"] += 1
            continue
        spans += n.looping_spans
        loop_tokens += n.loop_tokens
        masked += n.masked_tokens
        out.append((e._replace(mask=mask), source_index))
    return out, {"looping_turns": spans, "loop_tokens": loop_tokens, "loop_tokens_masked": masked}


def _tokenize(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, parts: dict[str, Any], path: Path, entry: Path,
              progress: bool) -> tuple[dict[str, np.ndarray], DataSummary]:
    records = read_source(cfg.source, cfg.format, cfg.max_samples)
    kwargs = encoder_kwargs(cfg)
    encoded = encode_all(records, tokenizer, kwargs, cfg.resolved_workers(), progress)
    skipped: Counter[str] = Counter(records.skipped)
    kept = [(e, records.source_index[i]) for i, e in enumerate(encoded) if not isinstance(e, str)]
    skipped.update(e for e in encoded if isinstance(e, str))
    kept, loops = _mask_loops(kept, cfg, skipped)
    if not kept:
        raise no_usable_rows(path, records.records_read, skipped, read_as=records.format,
                             first_rows=records.first_skipped, max_length=cfg.max_length,
                             min_loss_tokens=2 * cfg.block_size)
    lengths = np.fromiter((len(e.ids) for e, _ in kept), np.int64, len(kept))
    figures = _length_figures([e for e, _ in kept], lengths)
    starts = join_runs(lengths, cfg.max_length) if cfg.join else np.arange(len(kept) + 1)
    offsets = np.zeros(len(kept) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {
        "tokens": np.concatenate([e.ids for e, _ in kept]),
        "loss_mask": np.concatenate([e.mask for e, _ in kept]),
        "offsets": offsets[starts],      # a joined document spans its conversations' tokens
        "source_index": np.asarray([kept[i][1] for i in starts[:-1]], np.int64),   # its first one's
    }
    summary = DataSummary(
        source=cfg.source, path=str(path), cache_path=str(entry), from_cache=False,
        records_read=records.records_read, conversations=len(starts) - 1, skipped=dict(sorted(skipped.items())),
        joined_from=len(kept) if cfg.join else 0,
        max_samples=records.stopped_at or 0,
        truncated=sum(e.truncated for e, _ in kept), num_tokens=int(offsets[-1]),
        num_loss_tokens=int(arrays["loss_mask"].sum(dtype=np.int64)),
        reasoning_turns=sum(e.reasoning_turns for e, _ in kept),
        reasoning_dropped=sum(e.reasoning_dropped for e, _ in kept),
        max_length=cfg.max_length, **loops, **figures,
    )
    save_entry(entry, arrays, {"key_parts": parts, "summary": summary.to_dict()})
    return arrays, summary
