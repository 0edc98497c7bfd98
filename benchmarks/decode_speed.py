"""Wall-clock decode speed: target-only greedy decoding vs DFlash draft-and-verify.

Both loops are this repo's own (``dflash.eval.decode.greedy_decode`` and ``speculative_decode`` with a
:class:`~dflash.eval.decode.CachedDrafterProposer`): the target keeps a transformers KV cache in both, the
drafter keeps its context KV cache, batch size 1, greedy, and the outputs are checked equal (a
speculative decoder that changes the text is not faster, it is wrong). On a GPU every timed
region ends with ``torch.cuda.synchronize()``; one warm-up prompt is not timed.

    python -m benchmarks.decode_speed CHECKPOINT --data SOURCE [--num-prompts 16] [--max-new-tokens 256]
        [--out benchmarks/results/decode_h200.json]

Prompts are the run's held-out conversations, as ``dflash.eval --data`` picks them. Reports tokens/s
of each loop, the speedup, and the measured tau (tokens per verify step) of the timed decodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_speed", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="the run's data source (its held-out prompts, as dflash.eval)")
    src.add_argument("--prompts", help='JSONL of {"prompt": str}, as dflash.eval --prompts')
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)

    import msgspec

    from dflash.checkpoint.model_files import load_drafter
    from dflash.data.tokenizer import load_tokenizer
    from dflash.eval.cli import _prompts
    from dflash.eval.decode import (
        CachedDrafterProposer,
        greedy_decode,
        speculative_decode,
    )
    from dflash.eval.selector import is_dflash2, selector_proposer
    from dflash.model.target import for_generation, load_target

    device = torch.device(args.device)
    drafter, dc, tc = load_drafter(args.checkpoint, device)
    drafter.cfg = dc = msgspec.structs.replace(dc, attn_implementation="sdpa")  # as dflash.eval
    target = load_target(for_generation(tc), device, dc.num_layers, need_final=True)
    drafter.to(target.model.dtype)
    head = target.shared_head()
    tok = load_tokenizer(tc.tokenizer or tc.path or "builtin:tiny")
    ids = _prompts(args, tok)
    prompts = [torch.tensor(x, device=device) for x in ids]
    bs = dc.block_size
    # a DFlash2 drafter drafts with its selector walk (CachedDrafterProposer runs DFlash layers only;
    # selector_proposer keeps the same context cache)
    proposer = (lambda: selector_proposer(drafter, head)) if is_dflash2(drafter) else (
        lambda: CachedDrafterProposer(drafter, head))

    def timed(fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        return out, time.perf_counter() - t0

    greedy_decode(target, prompts[0], 16)                           # warm-up (kernels, allocator)
    speculative_decode(target, proposer(), prompts[0], 16, bs)
    t_plain = t_spec = 0.0
    steps = accepted = tokens = same = equal = 0
    for pr in prompts:
        ref, dt = timed(lambda: greedy_decode(target, pr, args.max_new_tokens))
        t_plain += dt
        (out, acc, _), dt = timed(lambda: speculative_decode(
            target, proposer(), pr, args.max_new_tokens, bs))
        t_spec += dt
        # bf16 on a GPU: a block-verify forward rounds differently from one-token forwards, so a
        # near-tie argmax can flip and the texts part; count the tokens before the first difference
        diff = (out != ref[: out.shape[0]]).nonzero()
        same += int(diff[0, 0]) - pr.shape[0] if len(diff) else args.max_new_tokens
        equal += not len(diff)
        steps, accepted, tokens = steps + len(acc), accepted + sum(acc), tokens + args.max_new_tokens
    res = {
        "command": "python -m benchmarks.decode_speed " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target": tc.path or tc.preset, "block_size": bs, "drafter_layers": dc.num_layers,
        "variant": dc.variant,
        "prompts": len(prompts), "new_tokens_per_prompt": args.max_new_tokens,
        "target_only_tok_s": tokens / t_plain, "speculative_tok_s": tokens / t_spec,
        "speedup": t_plain / t_spec, "tau": 1 + accepted / steps, "accepted_per_step": accepted / steps,
        "verify_steps": steps, "outputs_equal": equal, "tokens_before_first_difference": same / len(prompts),
    }
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
