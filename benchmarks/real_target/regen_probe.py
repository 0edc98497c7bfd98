"""One round of regeneration, timed per answer engine and KV cache on the same contexts: where
``dflash.regenerate``'s tokens per second go on a GPU, before a long run picks its settings.

    python -m benchmarks.real_target.regen_probe TARGET_DIR PROMPTS.jsonl [--contexts 512]
        [--max-new-tokens 128] [--settings generate:dynamic:512,generate:static:512,slots:-:512] [--json OUT]

``PROMPTS.jsonl`` is ShareGPT-style (``conversations`` of ``from``/``value``, or ``messages``); the
first user turn of each row, under the target's chat template, is one context (rows whose context
is longer than ``--max-prompt-tokens`` are skipped). Each setting ``ENGINE:CACHE:BATCH`` (the cache
is ``--engine generate``'s; the others ignore it) answers
every context greedily, twice: the first pass pays for compiling, the second is the rate reported
(answer tokens per second, wall clock, synchronised). Answers are compared with the first
setting's (identical rows; bf16 ties may part them, ``dflash.model.answers``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _contexts(path: Path, tok, n: int, max_prompt_tokens: int) -> list[list[int]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        turns = row.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(t.get("from"), t.get("from")),
                                         "content": t.get("value")} for t in row.get("conversations", [])]
        first = next((t for t in turns if t["role"] == "user" and isinstance(t["content"], str)), None)
        if first is None:
            continue
        ids = tok.apply_chat_template([{"role": "user", "content": first["content"]}], tokenize=True,
                                      add_generation_prompt=True, return_dict=True)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            out.append(list(ids))
        if len(out) == n:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("prompts", type=Path)
    p.add_argument("--contexts", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--settings", default="generate:dynamic:512,generate:static:512,slots:-:512")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.model.answers import answer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                                 attn_implementation="sdpa").to(device).eval()
    contexts = _contexts(args.prompts, tok, args.contexts, args.max_prompt_tokens)
    eos = [t for t in {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id} if isinstance(t, int) and t >= 0]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    print(f"regen_probe: {len(contexts)} contexts ({sum(map(len, contexts))} prompt tokens), "
          f"{args.max_new_tokens} new tokens each, on {device}", file=sys.stderr, flush=True)
    rows, first = [], None
    for setting in args.settings.split(","):
        engine, cache, batch = setting.split(":")
        times, answers = [], None
        for _ in range(2):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            answers = answer(model, contexts, max_new_tokens=args.max_new_tokens, eos=eos, pad=pad,
                             batch_size=int(batch), engine=engine, cache=cache if cache in ("dynamic", "static") else "dynamic")
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        tokens = sum(len(a) for a, _ in answers)
        first = first or answers
        row = {"setting": setting, "first_s": round(times[0], 2), "second_s": round(times[1], 2),
               "answer_tokens": tokens, "tokens_per_s": round(tokens / times[1], 1),
               "identical_to_first_setting": sum(a == b for (a, _), (b, _) in zip(answers, first))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"contexts": len(contexts), "max_new_tokens": args.max_new_tokens,
                                         "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
