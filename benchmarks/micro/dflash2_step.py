"""What DFlash2 costs per training step and per drafted block, against DFlash at the same shape.

Both drafters are built from the same graph file (default: the CPU example's shape against the
shipped target, ``examples/dflash-tiny.toml``), seeded alike, and fed the same batch: random
target features, random tokens, ``[train].num_anchors`` anchors per row. A training step is
``compute_loss`` + backward + AdamW, as :func:`dflash.train.step.train_step` runs it (bf16 autocast
on CUDA); a drafted block is one proposer call after a context of ``--context`` tokens (DFlash's
``CachedDrafterProposer``, DFlash2's ``CachedSelectorProposer``). The two variants alternate,
``--repeats`` rounds after a warm-up, and the median is reported::

    python -m benchmarks.micro.dflash2_step [GRAPH] [--set KEY=VALUE ...] [--repeats 20] [--device cpu]
    python -m benchmarks.micro.dflash2_step examples/sharegpt-target-h200.toml --device cuda

Prints one JSON object: ms per step and per block for each variant, their ratio, and the
parameters DFlash2 adds (convolutions, selector).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.micro.dflash2_step", description=__doc__.split("\n")[0])
    p.add_argument("graph", nargs="?", default="examples/dflash-tiny.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="graph override")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--context", type=int, default=256, help="context tokens before the drafted block")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU intra-op threads (0: torch's default; 1 is steadier on a shared machine)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import msgspec

    from dflash.eval.decode import CachedDrafterProposer
    from dflash.eval.selector import CachedSelectorProposer
    from dflash.messages import LossInput
    from dflash.model.drafter import DFlashDrafter, resolve_drafter_config
    from dflash.model.target import load_shared_head
    from dflash.run.config import load_config
    from dflash.train.anchors import sample_anchors
    from dflash.train.objective import compute_loss

    cfg = load_config(args.graph, args.set)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    head = load_shared_head(cfg.target, dev, torch.bfloat16 if cuda else torch.float32)
    base = resolve_drafter_config(cfg.drafter, cfg.target)
    H, V, k = base.hidden_size, base.vocab_size, len(base.target_layer_ids)
    if base.mask_token_id is None:  # a run takes it from the tokenizer; any id does for timing
        base = msgspec.structs.replace(base, mask_token_id=V - 1)
    rows, T = cfg.data.packed_rows, cfg.data.tokens_per_batch // cfg.data.packed_rows
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (rows, T), generator=g)
    lm = torch.ones(rows, T, dtype=torch.bool)
    doc = torch.zeros(rows, T, dtype=torch.int32)
    x = LossInput(features=torch.randn(rows, T, k * H, generator=g).to(dev, head.lm_head.weight.dtype),
                  input_ids=ids.to(dev), loss_mask=lm.to(dev), doc_ids=doc.to(dev),
                  position_ids=torch.arange(T)[None].expand(rows, T).contiguous().to(dev),
                  anchors=sample_anchors(lm, doc, cfg.train.num_anchors, base.block_size, g).to(dev),
                  final_hidden=torch.randn(rows, T, H, generator=g).to(dev, head.lm_head.weight.dtype))
    ctx_ids = torch.randint(0, V, (args.context + 1,), generator=g).to(dev)
    ctx_feats = torch.randn(1, args.context, k * H, generator=g).to(dev)

    variants = {}
    for v in ("dflash", "dflash2"):
        dc = msgspec.structs.replace(base, variant=v, attn_implementation="sdpa")
        d = DFlashDrafter(dc, seed=0).to(dev)
        opt = torch.optim.AdamW(d.parameters(), lr=1e-4, foreach=True)
        prop = CachedSelectorProposer if v == "dflash2" else CachedDrafterProposer
        variants[v] = (d, opt, prop)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def step(v):
        d, opt, _ = variants[v]
        sync()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = compute_loss(d, head, x, cfg.loss, sync_free=cfg.train.sync_free_loss,
                               lm_head_chunk=cfg.train.lm_head_chunk)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    def block(v):
        d, _, prop = variants[v]
        d.eval()
        proposer = prop(d, head)
        proposer.propose(ctx_ids, ctx_feats)                         # fills the context cache
        sync()
        t0 = time.perf_counter()
        proposer.propose(ctx_ids, ctx_feats)
        sync()
        d.train()
        return time.perf_counter() - t0

    times: dict[str, dict[str, list[float]]] = {v: {"step": [], "block": []} for v in variants}
    for v in variants:                                               # warm-up (kernels, allocator)
        step(v), block(v)
    for _ in range(args.repeats):
        for v in variants:
            times[v]["step"].append(step(v))
            times[v]["block"].append(block(v))
    med = {v: {k2: 1e3 * statistics.median(t) for k2, t in tt.items()} for v, tt in times.items()}
    d1, d2 = variants["dflash"][0], variants["dflash2"][0]
    n1 = sum(p.numel() for p in d1.parameters())
    n2 = sum(p.numel() for p in d2.parameters())
    sel = sum(p.numel() for p in d2.candidate_selector.parameters())
    res = {
        "command": "python -m benchmarks.micro.dflash2_step " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "device": torch.cuda.get_device_name(dev) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "shape": {"hidden": H, "vocab": V, "layers": base.num_layers, "block_size": base.block_size,
                  "rows": rows, "tokens_per_row": T, "anchors_per_row": cfg.train.num_anchors,
                  "conv_kernel_size": base.conv_kernel_size, "conv_group_size": base.conv_group_size,
                  "selector_top_k": base.selector_top_k, "selector_rank": base.selector_rank},
        "ms_per_step": {v: round(m["step"], 2) for v, m in med.items()},
        "step_ratio": round(med["dflash2"]["step"] / med["dflash"]["step"], 3),
        "ms_per_block": {v: round(m["block"], 3) for v, m in med.items()},
        "block_ratio": round(med["dflash2"]["block"] / med["dflash"]["block"], 3),
        "params": {"dflash": n1, "dflash2": n2, "convolutions": n2 - n1 - sel, "selector": sel},
        "repeats": args.repeats,
    }
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
