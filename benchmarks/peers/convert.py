"""Turn a peer's trained drafter into a drafter directory of this project, so that
``python -m dflash.eval`` and ``python -m benchmarks.decode.speed`` (z-lab's ``dflash_generate`` row
included) decode it exactly as they decode ours.

* a checkpoint ``speculators train`` wrote (vLLM speculators 0.9; its ``config.json`` has
  ``speculators_model_type``): speculators' DFlash-family checkpoints keep the public DFlash names
  for the drafter's body (``fc``, ``hidden_norm``, ``norm``, ``layers.N.*``; DFlash2's
  ``attention_conv`` / ``mlp_conv`` and ``candidate_selector.*`` with bare codebooks; XPress's
  ``refiner_head.*``), which are this project's names too; what they add is the verifier's
  embedding, LM head and norm (``embed_tokens``, ``lm_head``, ``verifier_*``: dropped, the target
  supplies them) and, with a reduced draft vocabulary, ``t2d`` / ``d2t`` (refused: the public layout
  has none). The config maps as :func:`drafter_config` says;
* a public-layout directory (``architectures = ["DFlashDraftModel"]`` or DFlash2's: what SpecForge's
  ``specforge.export.to_hf`` and z-lab write), read by :func:`dflash.export.load_exported`.

    python -m benchmarks.peers.convert GRAPH.toml SRC_DIR -o DIR [--set k=v ...]

``GRAPH.toml`` names the target (``[target]``) the drafter was trained against; it is recorded in
``DIR/target_config.json`` for the decoders. Exit 2 with one line when the drafter cannot be
represented (a reduced vocabulary, a bidirectional sliding window that binds, an unknown type).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

VERIFIER_KEYS = ("embed_tokens.", "lm_head.", "verifier_lm_head.", "verifier_norm.")
"""State-dict prefixes speculators fills from the verifier; the target supplies them here."""
TYPES = {"dflash": "dflash", "dflash2": "dflash2", "xpress": "xpress"}
"""speculators' ``speculators_model_type`` -> ``[drafter].variant``."""


class NotRepresentable(ValueError):
    """The speculators checkpoint has something this project's drafter (and the public layout) lacks."""


def layer_types(spec: dict[str, Any]) -> tuple[list[str], int | None]:
    """``(layer_types, sliding_window)`` for ``DrafterConfig`` from speculators' config.

    speculators' sliding layers attend causally inside the block, as this project's do, unless
    ``sliding_window_non_causal`` (DFlash2's default), where the block is bidirectional as in a
    full-attention layer: such a layer is written as full attention when its window covers every
    position the drafter can see (``sliding_window >= max_position_embeddings``), where the two are
    the same function.

    Raises:
        NotRepresentable: a bidirectional sliding layer whose window binds.
    """
    tl = spec["transformer_layer_config"]
    n = tl["num_hidden_layers"]
    types = list(tl.get("layer_types") or ["full_attention"] * n)
    window = tl.get("sliding_window")
    if "sliding_attention" not in types:
        return types, None
    if spec.get("sliding_window_non_causal"):
        if window is not None and window < tl["max_position_embeddings"]:
            raise NotRepresentable(f"bidirectional sliding-window layers (window {window} < "
                                   f"{tl['max_position_embeddings']} positions) have no public-layout "
                                   "equivalent: train with --full-attention-indices for every layer")
        return ["full_attention"] * n, None
    return types, window


def drafter_config(spec: dict[str, Any]):
    """This project's :class:`~dflash.model.drafter.DrafterConfig` for a speculators config.

    Raises:
        NotRepresentable: an unknown ``speculators_model_type``, a reduced draft vocabulary, or
            see :func:`layer_types`.
    """
    from dflash.model.drafter import DrafterConfig

    kind = spec.get("speculators_model_type")
    if kind not in TYPES:
        raise NotRepresentable(f"speculators_model_type {kind!r} is not one of {sorted(TYPES)}")
    tl = spec["transformer_layer_config"]
    if spec.get("draft_vocab_size") not in (None, tl["vocab_size"]):
        raise NotRepresentable(f"draft_vocab_size {spec['draft_vocab_size']} < the target's {tl['vocab_size']} "
                               "(a t2d/d2t vocabulary mapping): the public layout has none; train without "
                               "--draft-vocab-size")
    types, window = layer_types(spec)
    rope = tl.get("rope_parameters") or {}
    extra: dict[str, Any] = {}
    if kind == "dflash2":
        extra = {k: int(spec[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")}
    elif kind == "xpress":
        extra = {"xpress_rank": int(spec["xpress_rank"]), "xpress_mlp_ratio": int(spec["xpress_mlp_ratio"]),
                 "jacobi_passes": int(spec["num_jacobi_passes"])}
    return DrafterConfig(
        num_layers=tl["num_hidden_layers"], block_size=int(spec["block_size"]),
        mask_token_id=spec["mask_token_id"], layer_types=types, sliding_window=window,
        hidden_size=tl["hidden_size"], num_attention_heads=tl["num_attention_heads"],
        num_key_value_heads=tl.get("num_key_value_heads") or tl["num_attention_heads"],
        head_dim=tl.get("head_dim") or tl["hidden_size"] // tl["num_attention_heads"],
        intermediate_size=tl["intermediate_size"], rms_norm_eps=tl.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", tl.get("rope_theta") or 10_000.0)),
        max_position_embeddings=tl.get("max_position_embeddings"), vocab_size=tl["vocab_size"],
        target_layer_ids=list(spec["aux_hidden_state_layer_ids"]), variant=TYPES[kind], **extra)


def drafter_weights(path: Path) -> dict:
    """The checkpoint's tensors without the verifier's (:data:`VERIFIER_KEYS`), as fp32.

    Raises:
        NotRepresentable: it holds ``t2d`` / ``d2t``.
    """
    import torch
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        raise FileNotFoundError(f"{path} holds no model*.safetensors")
    if {"t2d", "d2t"} & weights.keys():
        raise NotRepresentable(f"{path} holds a t2d/d2t vocabulary mapping: the public layout has none")
    return {k: t.to(torch.float32) for k, t in weights.items() if not k.startswith(VERIFIER_KEYS)}


def convert(src: Path, out: Path, target_cfg) -> Any:
    """Write ``out`` (a drafter directory: :func:`dflash.checkpoint.model_files.save_drafter`) from a
    speculators checkpoint or a public-layout directory ``src``, and return its ``DrafterConfig``.

    Raises:
        NotRepresentable: see :func:`drafter_config`, :func:`drafter_weights`.
        ValueError: ``src`` is neither (``dflash.export.load_exported``'s message).
        RuntimeError: the tensors do not match the config (a missing or unexpected key).
    """
    import msgspec

    from dflash.checkpoint.format import META, Meta
    from dflash.checkpoint.model_files import save_drafter
    from dflash.export import load_exported
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import build_hf_config

    raw = json.loads((src / "config.json").read_text())
    depth = build_hf_config(target_cfg).num_hidden_layers
    if "speculators_model_type" in raw:
        cfg = msgspec.structs.replace(drafter_config(raw), num_target_layers=depth)
        drafter = DFlashDrafter(cfg)
        drafter.load_state_dict(drafter_weights(src), strict=True)
        origin = {"speculators_model_type": raw["speculators_model_type"],
                  "speculators_version": raw.get("speculators_version")}
    else:
        drafter, cfg = load_exported(src)
        cfg = msgspec.structs.replace(cfg, num_target_layers=depth)
        origin = {"architectures": raw.get("architectures")}
    if target_cfg.path is not None and Path(target_cfg.path).exists():  # decodable from any directory
        target_cfg = msgspec.structs.replace(target_cfg, path=str(Path(target_cfg.path).resolve()))
    out.mkdir(parents=True, exist_ok=True)
    save_drafter(out, drafter, cfg, target_cfg)
    (out / "converted_from.json").write_text(json.dumps({"source": str(src), **origin}, indent=1) + "\n")
    # last, as a checkpoint's: the decoders read a directory only once its meta.json says it is whole
    meta = Meta(step=0, batch_id=0, loss=None, healthy=True, time=time.time())
    (out / META).write_bytes(msgspec.json.encode(meta))
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.convert",
                                description=__doc__.split("\n")[0])
    p.add_argument("graph", help="the graph file (TOML) whose [target] the drafter was trained against")
    p.add_argument("checkpoint", help="a speculators checkpoint or a public-layout directory (config.json, "
                   "model.safetensors)")
    p.add_argument("-o", "--out", required=True, help="the drafter directory to write")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    import msgspec

    from dflash.errors import DFlashError
    from dflash.run.config import load_config

    try:
        cfg = load_config(args.graph, args.overrides)
        dc = convert(Path(args.checkpoint), Path(args.out), cfg.target)
    except (OSError, ValueError, RuntimeError, KeyError, DFlashError, msgspec.ValidationError) as e:
        print(f"peers.convert: {args.checkpoint}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"peers.convert: {dc.variant} drafter, {dc.num_layers} layers, block {dc.block_size}, target layers "
          f"{dc.target_layer_ids} -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
