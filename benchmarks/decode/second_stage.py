"""What a drafter's second stage costs per verify step: DFlash2's selector walk and XPress's Jacobi
passes, set against the target's verify forward and the drafter's backbone, batch 1.

Per block of ``bs`` tokens after ``--context`` cached tokens, each the median of ``--reps`` timed
runs after two warm-ups (every timed region synchronised on a GPU):

* ``verify``: the target's cached forward over the block and its LM head (the cache cropped back);
* ``backbone``: the drafter's block forward over its cached context and the LM head on slots
  1 .. bs-1 (the cached proposers' path, ``bs`` new context rows projected first, as a step does);
* ``second``: the second stage alone on that output: DFlash2's top-K and left-to-right walk, or
  XPress's :meth:`~dflash.model.xpress.XPressRefiner.jacobi` with all ``--passes`` passes (what it
  runs on a GPU; on a CPU it stops at a fixed point, which a trained refiner reaches sooner).

``share = second / (verify + backbone + second)`` is the second stage's part of a verify step; the
goal is at most 5%. The weights are random (speed needs no trained ones); the selector and the
refiner are moved off their zero init so the walk and the passes do their full work.

Targets: ``shipped`` (``dflash/assets/target-sharegpt-7m``, 3-layer drafter, as the H200 quality
runs) and ``qwen3-8b`` (the public Qwen3-8B shape, random init, 5-layer drafter); ``--tiny`` swaps
them for CPU-sized stand-ins (a test runs it).

    python -m benchmarks.decode.second_stage --out benchmarks/results/second_stage_h200.json
    python -m benchmarks.decode.second_stage --targets shipped --dtype float32   # a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.decode.projection import median_seconds

ASSET = Path(__file__).resolve().parents[2] / "dflash" / "assets" / "target-sharegpt-7m"
TARGETS = {"shipped": ({"path": str(ASSET)}, 3), "qwen3-8b": ({"preset": "qwen3-8b"}, 5)}
TINY = {"tiny": ({"preset": "tiny", "vocab_size": 512}, 2)}


@torch.no_grad()
def time_target(spec: dict, layers: int, bs: int, context: int, reps: int, passes: int, device: torch.device,
                dtype: str) -> dict:
    """``{verify_ms, variants: {name: {backbone_ms, second_ms, share}}}`` for one target."""
    from dflash.eval.decode import CachedTarget, crop_cache
    from dflash.eval.proposers import CachedDrafterProposer
    from dflash.eval.selector import CachedSelectorProposer
    from dflash.eval.xpress import CachedXPressProposer
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import TargetConfig, load_target

    target = load_target(TargetConfig(**spec, dtype=dtype), device, layers)
    V, H = target.hf_config.vocab_size, target.hf_config.hidden_size
    run = CachedTarget(target, context + 2 * bs)
    ctx = torch.randint(0, V, (context,), device=device)
    run(ctx, 0, last_only=True)
    block = ctx[-bs:]

    def verify():
        run(block, context)
        crop_cache(run.cache, context)

    res = {"verify_ms": 1e3 * median_seconds(verify, reps, device), "variants": {}}
    head = target.shared_head()
    feats = torch.randn(1, context - 1, len(target.layer_ids) * H, device=device, dtype=target.model.dtype)
    g = torch.Generator().manual_seed(0)
    for variant, proposer in (("dflash", CachedDrafterProposer), ("dflash2", CachedSelectorProposer),
                              ("xpress", CachedXPressProposer)):
        dc = DrafterConfig(num_layers=layers, block_size=bs, mask_token_id=0, variant=variant,
                           jacobi_passes=passes).resolve(target.hf_config, target.layer_ids)
        d = DFlashDrafter(dc, seed=0)
        for name, p in d.named_parameters():  # the walk and the passes off their zero init
            if "candidate_selector" in name or "refiner_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        d = d.to(device=device, dtype=target.model.dtype).eval()
        prop = proposer(d, head)
        prop.hidden(ctx, feats) if variant != "dflash2" else prop.slots(ctx, feats)

        def backbone():
            prop.cached = context - 1 - bs                        # bs new context rows per step
            if variant == "dflash2":
                return head.logits(prop.slots(ctx, feats))
            return head.logits(prop.hidden(ctx, feats)[:, 1:])

        row = {"backbone_ms": 1e3 * median_seconds(backbone, reps, device)}
        if variant == "dflash2":
            slots = prop.slots(ctx, feats)
            logits = head.logits(slots)

            def second():
                unary, cand = d.candidate_selector.candidates(logits)
                return d.candidate_selector.walk(slots, unary, cand, ctx[-1:])

        elif variant == "xpress":
            h = prop.hidden(ctx, feats)
            logits = head.logits(h[:, 1:])
            r = d.refiner_head

            def second():  # the decoder's own passes, every one run (a GPU's default; the worst case)
                return r.jacobi(logits, h, ctx[-2:-1], ctx[-1:], passes, stop_early=False)

        else:
            second = None
        if second is not None:
            row["second_ms"] = 1e3 * median_seconds(second, reps, device)
            row["share"] = row["second_ms"] / (res["verify_ms"] + row["backbone_ms"] + row["second_ms"])
        res["variants"][variant] = row
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode.second_stage", description=__doc__.split("\n")[0])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="tokens already in the KV caches")
    p.add_argument("--passes", type=int, default=6, help="XPress Jacobi passes (the released recipe's 6)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--targets", default="shipped,qwen3-8b", help="comma-separated: shipped, qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized stand-in target (a test)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    res = {"command": "python -m benchmarks.decode.second_stage " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "block_size": args.block_size, "context": args.context, "passes": args.passes, "dtype": args.dtype,
           "targets": {}}
    print("| target | verify ms | variant | backbone ms | second stage ms | share of a verify step |")
    print("|---|---:|---|---:|---:|---:|")
    chosen = TINY if args.tiny else {k: TARGETS[k] for k in args.targets.split(",")}
    for name, (spec, layers) in chosen.items():
        t = time_target(spec, layers, args.block_size, args.context, args.reps, args.passes, device, args.dtype)
        res["targets"][name] = t
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last target's memory, before the next one is built
        for variant, row in t["variants"].items():
            second = f"{row['second_ms']:.3f} | {100 * row['share']:.1f}%" if "second_ms" in row else "- | -"
            print(f"| {name} | {t['verify_ms']:.3f} | {variant} | {row['backbone_ms']:.3f} | {second} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
