"""The layout plan on paper: predicted best layouts for a 27B-class target + 1.7B drafter on 8, 16
(2 hosts) and 64 GPUs (8 hosts), and for the Qwen3-8B shape, from the model of :mod:`dflash.plan`.

    python benchmarks/plan/paper.py

Inputs (H200, benchmarks/results/LOG.md and results/h200.json): Qwen3-8B target alone 33.6K tok/s (flex,
15.5 GiB peak), 5-layer drafter (1.05B trainable, fp32 + AdamW) alone 44.5K tok/s (59.0 GiB peak),
colocation 0.99. The 27B-class shape (H 5376, 5 captured layers) is scaled by FLOPs per token:
target ``33.6K x 6.95B / 27B`` (forward FLOPs ~ 2 x non-embedding parameters; Qwen3-8B has 6.95B),
drafter ``44.5K x 1.05B / 1.7B`` (training FLOPs ~ 6 x trainable parameters), its activations by H.
Network: 400 Gbit/s per GPU (one NIC per GPU, the HGX H200 build); NVLink 450 GB/s per direction.
"""

from __future__ import annotations

from dflash.plan.measure import IDS_BYTES_PER_TOKEN
from dflash.plan.model import GIB, Inputs, colocated, layouts

H200_GIB = 141e9 / GIB
TOKENS = 16384
# Activation bytes per batch token, hidden unit and layer of that drafter run: its 59.0 GiB peak on
# 16,384 tokens less 15.6 GiB of fp32 weights, gradients and Adam moments and 2.3 GiB of the frozen
# bf16 embedding and LM head (a run's own check, dflash.run.memory, counts drafter slots instead)
ACT_BYTES = 131


def shape(target_tok_s: float, drafter_tok_s: float, hidden: int, drafter_params: float, target_params: float,
          target_gib: float | None = None) -> Inputs:
    state = 16 * drafter_params + ACT_BYTES * TOKENS * hidden * 5  # weights, grads, Adam; activations
    return Inputs(target_tok_s=target_tok_s, drafter_tok_s=drafter_tok_s, coloc=0.99,
                  coloc_source="results/LOG.md, one H200", bytes_per_token=5 * hidden * 2 + IDS_BYTES_PER_TOKEN,
                  grad_bytes=4 * drafter_params, tokens_per_batch=TOKENS,
                  target_mem=(target_gib * GIB) if target_gib else 2 * target_params, drafter_mem=state)


CASES = {
    "Qwen3-8B + 1.05B drafter": shape(33.6e3, 44.5e3, 4096, 1.05e9, 8.2e9, target_gib=15.5),
    "27B-class + 1.7B drafter": shape(33.6e3 * 6.95 / 27, 44.5e3 * 1.05 / 1.7, 5376, 1.7e9, 27e9),
}


def main() -> None:
    print("| model | GPUs (hosts) | best layout | tok/s | bound | vs colocated | runner-up | cross-host GB/s |")
    print("|---|---|---|---:|---|---:|---|---:|")
    for name, inp in CASES.items():
        for gpus, hosts in ((8, 1), (16, 2), (64, 8)):
            ranked = layouts(inp, gpus, hosts, H200_GIB)
            best, second, base = ranked[0], ranked[1], colocated(inp, gpus, hosts)
            print(f"| {name} | {gpus} ({hosts}) | {best.name} | {best.tok_s / 1e3:.0f}K | {best.bound} | "
                  f"{best.tok_s / base.tok_s:.2f}x | {second.name} ({second.tok_s / 1e3:.0f}K, {second.bound}) | "
                  f"{best.cross_host_gb_s:.1f} |")
    print()
    print("What runs out first as GPUs grow (colocated data-parallel, 27B-class; bound per GPU count):")
    inp = CASES["27B-class + 1.7B drafter"]
    for gpus, hosts in ((8, 1), (16, 2), (64, 8), (256, 32), (1024, 128)):
        base = colocated(inp, gpus, hosts)
        split = max((x for x in layouts(inp, gpus, hosts, H200_GIB) if x.kind == "split"), key=lambda x: x.tok_s)
        print(f"  {gpus:5d} GPUs: colocated {base.tok_s / 1e3:.0f}K ({base.bound}, {base.mem_gib:.0f} GiB/GPU); "
              f"best split {split.name} {split.tok_s / 1e3:.0f}K ({split.bound}, {split.cross_host_gb_s:.0f} GB/s "
              "across hosts)")


if __name__ == "__main__":
    main()
