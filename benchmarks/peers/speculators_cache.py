"""Write the hidden-state cache vLLM speculators 0.9 trains from, for the conversations a
``dflash.run`` of the same graph file trains on.

speculators never runs its target while it trains: ``speculators train`` reads a directory that its
own ``data_generation`` fills from a vLLM server. That server cannot run here, so this script fills
the same directory with this project's target (transformers, :func:`dflash.model.target.load_target`)
from this project's tokenized data, with the held-out conversations (``[data].holdout``) left out
exactly as ``dflash.run`` leaves them out:

* ``DIR/hidden_states/hs_{i}.safetensors``: ``token_ids`` ``[n]`` int64 and ``hidden_states``
  ``[n, k + 1, H]`` bf16, the outputs of the ``k`` decoder layers the drafter reads
  (``target_layer_ids``: HF's ``hidden_states[id + 1]``, z-lab's ``extract_context_feature``
  convention) and, last, the output of the target's last decoder layer *before* its final norm
  (speculators applies the verifier's norm itself: ``verifier_norm(verifier_last_hidden_states)``);
* ``DIR/rows.jsonl``: ``{"input_ids": [...], "loss_mask": [...]}`` per conversation, in the same
  order; ``benchmarks/peers/speculators_rows.py`` (run by speculators' own interpreter, which has
  ``datasets``) turns it into the Arrow dataset ``speculators train --data-path DIR`` reads;
* ``DIR/cache.json``: conversations, tokens, layer ids, the target (an absolute path), the drafter's
  shape and the batch size the peers are to be given, and the seconds the cache took (reported
  apart from the training budget: the peers' cache build is not charged to them).

    python -m benchmarks.peers.speculators_cache GRAPH.toml -o DIR [--set k=v ...] [--device cuda]
        [--max-conversations N]

Exit 2 with one line on a config or data error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def cache_layer_ids(drafter_ids: list[int], num_target_layers: int) -> list[int]:
    """The target layers to capture, in file order: the drafter's, then the last layer.

    Raises:
        ValueError: the drafter already reads the last layer (speculators stores that one apart
            as ``verifier_last_hidden_states``; a drafter conditioned on it does not export either,
            see :func:`dflash.export.last_layer_problem`).
    """
    last = num_target_layers - 1
    if last in drafter_ids:
        raise ValueError(f"the drafter reads the target's last layer ({last}); speculators keeps that "
                         "layer apart: choose target.layer_ids below it")
    return [*drafter_ids, last]


def write_cache(graph: str, out: Path, overrides: list[str], device: str,
                max_conversations: int | None) -> dict:
    """Fill ``out`` (module doc) and return what ``cache.json`` records."""
    import torch
    from safetensors.torch import save_file

    from dflash.data import load_dataset, load_tokenizer
    from dflash.model.drafter_config import resolve_drafter_config
    from dflash.model.target import build_hf_config, for_generation, load_target
    from dflash.run.config import load_config

    t0 = time.perf_counter()
    cfg = load_config(graph, overrides)
    tok = load_tokenizer(cfg.target.tokenizer_source)
    if cfg.target.path is None and cfg.target.vocab_size is None:
        cfg.target.vocab_size = len(tok)
    dataset = load_dataset(cfg.data, tok, quiet=True)
    train, heldout = dataset.split(cfg.data.holdout, cfg.data.seed)
    n = len(train) if max_conversations is None else min(max_conversations, len(train))
    drafter_ids = resolve_drafter_config(cfg.drafter, cfg.target).target_layer_ids
    hf = build_hf_config(cfg.target)
    ids = cache_layer_ids(list(drafter_ids), hf.num_hidden_layers)
    tc = for_generation(cfg.target)
    tc.layer_ids = ids
    target = load_target(tc, device, cfg.drafter.num_layers, need_final=False)
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    tokens = 0
    t_forward = time.perf_counter()
    with open(out / "rows.jsonl", "w") as rows, torch.no_grad():
        for i in range(n):
            span, mask = train.span(i)
            x = torch.as_tensor(span.astype("int64"), device=device)[None]
            pos = torch.arange(x.shape[1], device=device)[None]
            feats, _ = target(x, pos, torch.zeros_like(x), need_final=False)  # [1, n, (k+1)*H]
            hs = feats[0].view(x.shape[1], len(ids), hf.hidden_size).to(torch.bfloat16).cpu().contiguous()
            save_file({"token_ids": x[0].cpu(), "hidden_states": hs}, str(hs_dir / f"hs_{i}.safetensors"))
            rows.write(json.dumps({"input_ids": span.tolist(), "loss_mask": mask.astype(int).tolist()}) + "\n")
            tokens += x.shape[1]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    info = {"graph": str(graph), "overrides": overrides,
            "target": str(Path(cfg.target.path).resolve()) if cfg.target.path else cfg.target.preset,
            "drafter_layers": cfg.drafter.num_layers, "block_size": cfg.drafter.block_size,
            "tokens_per_batch": cfg.data.tokens_per_batch, "conversations": n,
            "heldout_left_out": len(heldout), "tokens": tokens,
            "target_layer_ids": list(drafter_ids), "captured_layer_ids": ids,
            "hidden_size": hf.hidden_size, "device": device,
            "seconds_target": time.perf_counter() - t_forward, "seconds_total": time.perf_counter() - t0}
    (out / "cache.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.speculators_cache",
                                description=__doc__.split("\n")[0])
    p.add_argument("graph", help="the graph file (TOML) whose [data], [target] and [drafter] the peers share")
    p.add_argument("-o", "--out", required=True, help="the speculators data directory to fill")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default=None, help="where the target runs (default: cuda if available)")
    p.add_argument("--max-conversations", type=int, default=None, help="the first N training conversations only")
    args = p.parse_args(argv)
    import msgspec
    import torch

    from dflash.errors import DFlashError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    if (out / "hidden_states").exists():
        print(f"speculators_cache: {out} already holds a cache; remove it or use another -o", file=sys.stderr)
        return 2
    try:
        info = write_cache(args.graph, out, args.overrides, device, args.max_conversations)
    except (OSError, ValueError, DFlashError, msgspec.ValidationError) as e:
        print(f"speculators_cache: {e}", file=sys.stderr)
        return 2
    print(f"speculators_cache: {info['conversations']} conversations, {info['tokens']} tokens, layers "
          f"{info['captured_layer_ids']} -> {out} in {info['seconds_total']:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
