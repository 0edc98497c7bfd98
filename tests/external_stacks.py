"""Load an export with SpecForge's and vLLM speculators' own DFlash classes, in their own venvs.

Neither package is a dependency (SpecForge pins transformers 5.8.1 and needs sglang; speculators
pins transformers <= 5.19), so the check runs in two steps:

1. ``python tests/external_stacks.py fixture DIR [full]`` (the project's venv) writes ``DIR/export``
   (a tiny drafter through ``dflash.export``: a sliding-window layer then a full one, or two full
   ones with ``full``), ``DIR/target`` (its tiny target, ``save_pretrained``)
   and ``DIR/ref.safetensors``: context features ``feats [1, T, k*H]``, the token ids
   ``ids [1, T+bs]`` whose ``ids[T]`` is the block's anchor, and this project's drafter's
   ``hidden [1, bs, H]`` and ``logits [1, bs, V]`` (the target's LM head) for the block
   ``[ids[T], mask, ...]`` at positions ``T..T+bs-1`` after that context.
2. ``python tests/external_stacks.py specforge DIR SPECFORGE_DIR`` or ``... speculators DIR``
   (the other stack's venv; imports no ``dflash`` module) loads the export with that stack's class,
   prints ``missing=[...] unexpected=[...] max_abs_logit_diff=X versions=...`` and exits 1 unless
   no key is missing or unexpected and the logits agree within 1e-4.

SpecForge (PyPI ``specforge`` 0.2.0) needs sglang 0.5.14 (CUDA); only its DFlash model file
(``specforge/modeling/draft/dflash.py`` with its ``dflash_kernels.py`` and ``registry.py``, which
import torch and transformers only) is loaded, from the unpacked wheel at ``SPECFORGE_DIR``.
speculators (PyPI ``speculators`` 0.9.0) installs on CPU; its ``DFlashConverter`` turns the export
into a speculators checkpoint, as its docs say to do for a z-lab DFlash drafter, and its
``DFlashDraftModel`` runs the block through its own training forward (anchored blocks; the
anchor at ``T`` is the only valid one, so the block sees exactly the context ``0..T-1``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

T = 12  # context tokens before the block
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]  # window 8 < T: the window matters


def fixture(out: Path, types: list[str] | None = SLIDING_THEN_FULL) -> None:
    from dflash.export import export_drafter, load_exported
    from dflash.model.attention import decode_layout
    from dflash.model.target import load_target
    from tests.dflash.export.test_export import ABOUT, TCFG, make

    export_drafter(make(types), out / "export", torch.float32, about=ABOUT)
    drafter, cfg = load_exported(out / "export")
    target = load_target(TCFG, "cpu", 2).model.float().eval()
    target.save_pretrained(out / "target")
    bs, H = cfg.block_size, target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 4000, (1, T + bs), generator=g)
    with torch.no_grad():
        hs = target(ids[:, :T], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], dim=-1)  # [1, T, k*H]
        block = torch.full((1, bs), cfg.mask_token_id)
        block[0, 0] = ids[0, T]
        emb = target.get_input_embeddings()(block)
        hidden = drafter(feats, emb[:, None], decode_layout(T, T, bs, "cpu")).reshape(1, bs, H)
        logits = target.lm_head(hidden)
    save_file({"feats": feats.contiguous(), "ids": ids, "hidden": hidden.contiguous(),
               "logits": logits.contiguous()}, str(out / "ref.safetensors"))


def fixture_xpress(out: Path) -> None:
    """``fixture`` for an XPress drafter: ``DIR/export`` (full-attention layers), ``DIR/target``, and
    ``DIR/ref.safetensors`` with, besides ``feats``/``ids``/``hidden``/``logits``, the block slots'
    predecessors ``prev [1, bs]`` and this project's refiner bias ``bias [1, bs, V]`` for them."""
    from dflash.export import export_drafter, load_exported
    from dflash.model.attention import decode_layout
    from dflash.model.target import load_target
    from tests.dflash.export.test_export import ABOUT, TCFG
    from tests.dflash.export.test_xpress_export import make

    export_drafter(make(), out / "export", torch.float32, about=ABOUT)
    drafter, cfg = load_exported(out / "export")
    target = load_target(TCFG, "cpu", 2).model.float().eval()
    target.save_pretrained(out / "target")
    bs, H = cfg.block_size, target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 4000, (1, T + bs), generator=g)
    prev = torch.randint(5, 4000, (1, bs), generator=g)
    with torch.no_grad():
        hs = target(ids[:, :T], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], dim=-1)
        block = torch.full((1, bs), cfg.mask_token_id)
        block[0, 0] = ids[0, T]
        emb = target.get_input_embeddings()(block)
        hidden = drafter(feats, emb[:, None], decode_layout(T, T, bs, "cpu")).reshape(1, bs, H)
        r = drafter.refiner_head
        bias = r.bias(r.features(prev, r.context(hidden)))
        logits = target.lm_head(hidden)
    save_file({"feats": feats.contiguous(), "ids": ids, "hidden": hidden.contiguous(), "prev": prev,
               "bias": bias.contiguous(), "logits": logits.contiguous()}, str(out / "ref.safetensors"))


def _import_specforge_model(src: Path):
    """SpecForge's ``specforge/modeling/draft/dflash.py`` as a module, without importing the rest
    of SpecForge (whose package ``__init__`` needs sglang)."""
    draft = src / "specforge" / "modeling" / "draft"
    for name, path in (("specforge", src / "specforge"), ("specforge.modeling", src / "specforge" / "modeling"),
                       ("specforge.modeling.draft", draft)):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    for name in ("registry", "dflash_kernels", "dflash"):
        spec = importlib.util.spec_from_file_location(f"specforge.modeling.draft.{name}", draft / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["specforge.modeling.draft.dflash"]


def check_specforge(fx: Path, src: Path) -> dict:
    import transformers

    sf = _import_specforge_model(src)
    ref = load_file(str(fx / "ref.safetensors"))
    model, info = sf.DFlashDraftModel.from_pretrained(fx / "export", dtype=torch.float32, output_loading_info=True)
    target = transformers.AutoModelForCausalLM.from_pretrained(fx / "target", dtype=torch.float32).eval()
    model.eval()
    bs = model.block_size
    block = torch.full((1, bs), model.mask_token_id)
    block[0, 0] = ref["ids"][0, T]
    # SpecForge's forward applies a sliding window only through the mask it is given (its sdpa path
    # ignores ``sliding_window``), so the sliding layers get the DFlash decode mask: the context
    # within the window, the block causally. Its own spec_generate passes none (reported too).
    q, k = torch.arange(T, T + bs)[:, None], torch.arange(T + bs)[None, :]
    window = model.config.sliding_window or T + bs
    sliding = ((q - k) < window) & ((k < T) | (k <= q))
    masks = {"full_attention": None, "sliding_attention": sliding[None, None]}
    with torch.no_grad():
        kw = {"position_ids": torch.arange(T + bs)[None], "noise_embedding": target.model.embed_tokens(block),
              "target_hidden": ref["feats"]}
        logits = target.lm_head(model(attention_mask=masks, **kw))
        unmasked = target.lm_head(model(**kw))
    return {"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "max_abs_logit_diff": (logits - ref["logits"]).abs().max().item(),
            "max_abs_logit_diff_without_masks": (unmasked - ref["logits"]).abs().max().item(),
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}


def check_speculators(fx: Path) -> dict:
    from importlib.metadata import version

    import transformers
    from speculators.convert.dflash import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel

    ref = load_file(str(fx / "ref.safetensors"))
    conv = fx / "speculators"
    DFlashConverter().convert(fx / "export", conv, base_model=str(fx / "target"))
    model, info = DFlashDraftModel.from_pretrained(conv, dtype=torch.float32, output_loading_info=True,
                                                   attn_implementation="eager")
    model.load_verifier_weights()
    model.eval()
    bs = model.block_size
    ids = torch.cat([ref["ids"], torch.full((1, bs), 5)], dim=1)  # select_anchors skips the last bs positions
    S = ids.shape[1]
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, T] = 1  # the only valid anchor: the block at T after the context 0..T-1
    with torch.no_grad():
        last = torch.zeros(1, S, model.config.transformer_layer_config.hidden_size)
        feats = torch.cat([ref["feats"], torch.zeros(1, S - T, ref["feats"].shape[-1])], dim=1)
        _, logits, _, _, idx = model._backbone_forward(feats, ids, loss_mask, last,
                                                            torch.zeros(1, S, dtype=torch.long), max_anchors=1)
    assert idx.tolist() == list(range(T, T + bs)), idx
    return {"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "max_abs_logit_diff": (logits - ref["logits"]).abs().max().item(),
            "versions": {"speculators": version("speculators"), "transformers": transformers.__version__,
                         "torch": torch.__version__}}


def check_speculators_xpress(fx: Path) -> dict:
    """speculators' ``XPressDraftModel`` built from the export as its ``DFlashConverter`` builds a
    DFlash one (the converter's config, plus the ``dflash_config`` XPress fields), loading the
    export's tensors as they are: the missing keys must be only those filled from the verifier,
    the backbone's logits and the refiner's bias must be ours."""
    from importlib.metadata import version

    import transformers
    from speculators.convert.dflash import DFlashConverter
    from speculators.convert.dflash.converter import _VERIFIER_FILLED_KEYS
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig

    ref = load_file(str(fx / "ref.safetensors"))
    source = json.loads((fx / "export" / "config.json").read_text())
    base = DFlashConverter()._build_config(source, str(fx / "target"), None)
    dfc = source["dflash_config"]
    cfg = XPressSpeculatorConfig(transformer_layer_config=base.transformer_layer_config,
                                 draft_vocab_size=base.draft_vocab_size, block_size=base.block_size,
                                 aux_hidden_state_layer_ids=base.aux_hidden_state_layer_ids,
                                 mask_token_id=base.mask_token_id, speculators_config=base.speculators_config,
                                 xpress_rank=dfc["xpress_rank"], xpress_mlp_ratio=dfc["xpress_mlp_ratio"],
                                 num_jacobi_passes=dfc["num_jacobi_passes"])
    model = XPressDraftModel(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(fx / "export" / "model.safetensors")), strict=False)
    model.load_verifier_weights()
    model.float().eval()
    bs = model.block_size
    ids = torch.cat([ref["ids"], torch.full((1, bs), 5)], dim=1)
    S = ids.shape[1]
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, T] = 1
    with torch.no_grad():
        last = torch.zeros(1, S, model.config.transformer_layer_config.hidden_size)
        feats = torch.cat([ref["feats"], torch.zeros(1, S - T, ref["feats"].shape[-1])], dim=1)
        _, logits, _, _, idx = model._backbone_forward(feats, ids, loss_mask, last,
                                                       torch.zeros(1, S, dtype=torch.long), max_anchors=1)
        bias = model.refiner_head.block_bias(ref["prev"], hidden_states=ref["hidden"])
    assert idx.tolist() == list(range(T, T + bs)), idx
    return {"missing": sorted(k for k in missing if k not in _VERIFIER_FILLED_KEYS), "unexpected": sorted(unexpected),
            "max_abs_logit_diff": max((logits - ref["logits"]).abs().max().item(),
                                      (bias - ref["bias"]).abs().max().item()),
            "versions": {"speculators": version("speculators"), "transformers": transformers.__version__,
                         "torch": torch.__version__}}


def main(argv: list[str]) -> int:
    what, fx = argv[0], Path(argv[1])
    if what == "fixture":
        fixture(fx, None if argv[2:] == ["full"] else SLIDING_THEN_FULL)
        return 0
    if what == "fixture_xpress":
        fixture_xpress(fx)
        return 0
    checks = {"specforge": lambda: check_specforge(fx, Path(argv[2])), "speculators": lambda: check_speculators(fx),
              "speculators_xpress": lambda: check_speculators_xpress(fx)}
    got = checks[what]()
    print(json.dumps(got))
    ok = not got["missing"] and not got["unexpected"] and got["max_abs_logit_diff"] <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main(sys.argv[1:]))
