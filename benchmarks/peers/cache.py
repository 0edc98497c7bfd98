"""Write the hidden-state caches the peers train from (vLLM speculators 0.9, SpecForge 0.2), for
the conversations a ``dflash.run`` of the same graph file trains on.

Neither peer runs its target while it trains offline: each reads a directory that its own capture
fills from a serving engine (vLLM, SGLang). Those cannot run here, so this script fills the same
directories with this project's target (transformers, :func:`dflash.model.target.load_target`) from
this project's tokenized data, with the held-out conversations (``[data].holdout``) left out exactly
as ``dflash.run`` leaves them out. One target pass writes every format asked for:

* ``--peer speculators`` -> ``DIR/speculators/``:
  ``hidden_states/hs_{i}.safetensors`` with ``token_ids`` ``[n]`` int64 and ``hidden_states``
  ``[n, k + 1, H]`` bf16: the outputs of the ``k`` decoder layers the drafter reads
  (``target_layer_ids``: HF's ``hidden_states[id + 1]``, z-lab's ``extract_context_feature``
  convention) and, last, the output of the target's last decoder layer *before* its final norm
  (speculators applies the verifier's norm itself: ``verifier_norm(verifier_last_hidden_states)``);
  and ``rows.jsonl``, ``{"input_ids": [...], "loss_mask": [...]}`` per conversation in the same
  order, which ``benchmarks/peers/speculators_rows.py`` (run by speculators' own interpreter, which
  has ``datasets``) turns into the Arrow dataset ``speculators train --data-path`` reads;
* ``--peer specforge`` -> ``DIR/specforge/data_{i}.ckpt``: ``torch.save`` of ``input_ids`` ``[n]``
  int64, ``loss_mask`` ``[n]`` int64 and ``hidden_states`` ``[n, k * H]`` bf16 (the ``k`` layers
  concatenated; SpecForge's DFlash reads no last layer), the files its ``OfflineManifestReader``
  lists under ``data.hidden_states_path``;
* ``DIR/draft_config.json``: the graph's drafter shape as a public-layout DFlash ``config.json``
  (its layers, block size, target layers, mask token), which SpecForge builds its drafter from;
* ``DIR/cache.json``: conversations, tokens, layer ids, the target (an absolute path), the drafter's
  shape, its mask token (``[drafter].mask_token_id``, else the tokenizer's: what ``dflash.run``
  trains with) and the batch the peers are to be given, and the seconds the cache took (reported
  apart from the training budget: the peers' cache build is not charged to them).

    python -m benchmarks.peers.cache GRAPH.toml -o DIR [--peer speculators] [--peer specforge]
        [--set k=v ...] [--device cuda] [--max-conversations N]

Exit 2 with one line on a config or data error.
"""

from __future__ import annotations

import argparse
import contextlib
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


PEERS = ("speculators", "specforge")


def write_cache(graph: str, out: Path, overrides: list[str], device: str,
                max_conversations: int | None, peers: tuple[str, ...] = PEERS) -> dict:
    """Fill ``out`` for ``peers`` (module doc) and return what ``cache.json`` records."""
    import msgspec
    import torch
    from safetensors.torch import save_file

    from dflash.data import load_dataset, load_tokenizer
    from dflash.export import hf_config_dict
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
    drafter_cfg = resolve_drafter_config(cfg.drafter, cfg.target)
    if drafter_cfg.mask_token_id is None:  # as dflash.run resolves it
        if tok.mask_token_id is None:
            raise ValueError("[drafter].mask_token_id is not set and the tokenizer has no mask token: "
                             "set drafter.mask_token_id to an unused token id")
        drafter_cfg = msgspec.structs.replace(drafter_cfg, mask_token_id=tok.mask_token_id)
    drafter_ids = drafter_cfg.target_layer_ids
    hf = build_hf_config(cfg.target)
    ids = cache_layer_ids(list(drafter_ids), hf.num_hidden_layers)
    tc = for_generation(cfg.target)
    tc.layer_ids = ids
    target = load_target(tc, device, cfg.drafter.num_layers, need_final=False)
    spec_dir, forge_dir = out / "speculators", out / "specforge"
    if "speculators" in peers:
        (spec_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    if "specforge" in peers:
        forge_dir.mkdir(parents=True, exist_ok=True)
    tokens = 0
    t_forward = time.perf_counter()
    with contextlib.ExitStack() as stack, torch.no_grad():
        rows = stack.enter_context(open(spec_dir / "rows.jsonl", "w")) if "speculators" in peers else None
        for i in range(n):
            span, mask = train.span(i)
            x = torch.as_tensor(span.astype("int64"), device=device)[None]
            pos = torch.arange(x.shape[1], device=device)[None]
            feats, _ = target(x, pos, torch.zeros_like(x), need_final=False)  # [1, n, (k+1)*H]
            hs = feats[0].view(x.shape[1], len(ids), hf.hidden_size).to(torch.bfloat16).cpu()
            token_ids = x[0].cpu()
            if rows is not None:
                save_file({"token_ids": token_ids, "hidden_states": hs.contiguous()},
                          str(spec_dir / "hidden_states" / f"hs_{i}.safetensors"))
                rows.write(json.dumps({"input_ids": span.tolist(), "loss_mask": mask.astype(int).tolist()}) + "\n")
            if "specforge" in peers:
                torch.save({"input_ids": token_ids, "loss_mask": torch.as_tensor(mask.astype("int64")),
                            "hidden_states": hs[:, :-1].flatten(1).contiguous()}, forge_dir / f"data_{i}.ckpt")
            tokens += x.shape[1]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    info = {"graph": str(graph), "overrides": overrides,
            "target": str(Path(cfg.target.path).resolve()) if cfg.target.path else cfg.target.preset,
            "drafter_layers": cfg.drafter.num_layers, "block_size": cfg.drafter.block_size,
            "tokens_per_batch": cfg.data.tokens_per_batch, "conversations": n,
            "heldout_left_out": len(heldout), "tokens": tokens,
            "target_layer_ids": list(drafter_ids), "captured_layer_ids": ids, "peers": list(peers),
            "mask_token_id": drafter_cfg.mask_token_id, "num_target_layers": hf.num_hidden_layers,
            "max_length": cfg.data.max_length,
            "hidden_size": hf.hidden_size, "device": device,
            "seconds_target": time.perf_counter() - t_forward, "seconds_total": time.perf_counter() - t0}
    (out / "cache.json").write_text(json.dumps(info, indent=1) + "\n")
    # the drafter shape as a public-layout config: SpecForge builds its DFlash drafter from it
    # (model.draft_model_config) and exports with it, so its layers, block size, target layers and
    # mask token are the graph's; SpecForge 0.2 trains DFlash only
    draft = hf_config_dict(msgspec.structs.replace(drafter_cfg, variant="dflash"), torch.bfloat16)
    (out / "draft_config.json").write_text(json.dumps(draft, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.cache",
                                description=__doc__.split("\n")[0])
    p.add_argument("graph", help="the graph file (TOML) whose [data], [target] and [drafter] the peers share")
    p.add_argument("-o", "--out", required=True, help="the directory to fill (one subdirectory per peer)")
    p.add_argument("--peer", action="append", choices=PEERS, default=None,
                   help="a peer whose format to write (repeatable; default: both)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default=None, help="where the target runs (default: cuda if available)")
    p.add_argument("--max-conversations", type=int, default=None, help="the first N training conversations only")
    args = p.parse_args(argv)
    import msgspec
    import torch

    from dflash.errors import DFlashError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    if (out / "cache.json").exists() or any((out / p).exists() for p in PEERS):
        print(f"peers.cache: {out} already holds a cache; remove it or use another -o", file=sys.stderr)
        return 2
    try:
        info = write_cache(args.graph, out, args.overrides, device, args.max_conversations,
                           tuple(args.peer or PEERS))
    except (OSError, ValueError, DFlashError, msgspec.ValidationError) as e:
        print(f"peers.cache: {e}", file=sys.stderr)
        return 2
    print(f"peers.cache: {', '.join(info['peers'])}: {info['conversations']} conversations, {info['tokens']} "
          f"tokens, layers {info['captured_layer_ids']} -> {out} in {info['seconds_total']:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
