"""An XPress drafter exports with its refiner under speculators' ``refiner_head`` names and its
settings in ``dflash_config``; it reads back into ours, loads in transformers' AutoModel through our
modeling file (the same Jacobi drafts) and decodes there with ``spec_generate`` to the target's
greedy text."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash.export import export_drafter, load_exported
from dflash.model.attention import decode_layout
from dflash.model.drafter import DFlashDrafter, DrafterConfig, resolve_drafter_config
from tests.dflash.export.test_dflash2_export import TCFG, inputs
from tests.dflash.model.test_spec_generate import PROMPT, _greedy, _target

pytestmark = pytest.mark.timeout(300)

T, BS, H = 12, 4, 128


def make() -> DFlashDrafter:
    """An XPress drafter whose refiner is far from its zero-readout init."""
    dc = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=4095, variant="xpress", xpress_rank=8,
                       xpress_mlp_ratio=3, jacobi_passes=2)
    d = DFlashDrafter(resolve_drafter_config(dc, TCFG), seed=3).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.refiner_head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return d


def _ours(d, feats, emb, head, before, anchor):
    with torch.no_grad():
        h = d(feats, emb[:, None], decode_layout(T, T, BS, "cpu")).reshape(1, BS, H)
        return h, d.refiner_head.jacobi(h[:, 1:] @ head.T, h, before, anchor, d.cfg.jacobi_passes)[0]


def test_export_layout_and_round_trip(tmp_path):
    d = make()
    export_drafter(d, tmp_path, torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["XPressDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.XPressDraftModel"}
    assert {k: cfg["dflash_config"][k] for k in ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")} == {
        "xpress_rank": 8, "xpress_mlp_ratio": 3, "num_jacobi_passes": 2}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(d.state_dict())
    assert {"refiner_head.token_embed.weight", "refiner_head.mix_l", "refiner_head.readout.weight",
            "refiner_head.mlp_down.weight"} <= names
    back, bcfg = load_exported(tmp_path)
    assert (bcfg.variant, bcfg.xpress_rank, bcfg.xpress_mlp_ratio, bcfg.jacobi_passes) == ("xpress", 8, 3, 2)
    feats, emb = inputs()
    head = torch.randn(4096, H, generator=torch.Generator().manual_seed(2)) * 0.05  # the refiner matters
    before, anchor = torch.tensor([3]), torch.tensor([7])
    for got, want in zip(_ours(back, feats, emb, head, before, anchor), _ours(d, feats, emb, head, before, anchor)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "XPress drafter" in (tmp_path / "README.md").read_text()


def test_automodel_refines_as_we_do_and_spec_generate_is_the_target_greedy_text(tmp_path):
    from transformers import AutoModel

    d = make()
    export_drafter(d, tmp_path / "export", torch.float32)
    model = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "XPressDraftModel"
    assert all(torch.equal(p, d.state_dict()[k]) for k, p in model.state_dict().items())
    assert model.state_dict().keys() == d.state_dict().keys()
    feats, emb = inputs()
    head = torch.randn(4096, H, generator=torch.Generator().manual_seed(2)) * 0.05  # the refiner matters
    before, anchor = torch.tensor([3]), torch.tensor([7])
    h, want = _ours(d, feats, emb, head, before, anchor)
    with torch.no_grad():
        out = model(target_hidden=feats, noise_embedding=emb)
        got, _ = model.refine(out, out[:, 1:] @ head.T, before, anchor)
    torch.testing.assert_close(out, h, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, want) and not torch.equal(want, (h[:, 1:] @ head.T).argmax(-1))
    target = _target(noise=1e-3)
    assert torch.equal(model.spec_generate(target, PROMPT, max_new_tokens=30, stop_token_ids=None),
                       _greedy(target, PROMPT, 30))
    sampled = model.spec_generate(target, PROMPT, max_new_tokens=12, stop_token_ids=None, temperature=0.8)
    assert sampled.shape == (1, PROMPT.shape[1] + 12)


def test_eval_cli_decodes_an_xpress_checkpoint_with_the_passes_asked(tmp_path, capsys):
    """``dflash.eval --jacobi-passes K`` decodes an XPress checkpoint with K passes and records K;
    0 drafts the backbone's argmax, so its tau is the DFlash drafter's of the same backbone."""
    from dflash.eval.cli import main
    from tests.helpers import save_checkpoint

    d, ck = make(), tmp_path / "ckpt"
    ck.mkdir()
    save_checkpoint(ck, d, d.cfg, TCFG)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "How do I sort a list?"}\n{"prompt": "Name three rivers."}\n')
    base = [str(ck), "--prompts", str(prompts), "--max-new-tokens", "8", "--device", "cpu", "--no-speedup", "--json"]
    got = {}
    for k in ("0", "3"):
        assert main([*base, "--jacobi-passes", k]) == 0
        got[k] = json.loads(capsys.readouterr().out)
        assert got[k]["jacobi_passes"] == int(k)
    assert main([*base, "--jacobi-passes", "-1"]) == 2
    assert "give 0 or more passes" in capsys.readouterr().err
    import msgspec

    plain = DFlashDrafter(msgspec.structs.replace(d.cfg, variant="dflash")).eval()
    plain.load_state_dict({k: v for k, v in d.state_dict().items() if not k.startswith("refiner_head.")})
    ck2 = tmp_path / "plain"
    ck2.mkdir()
    save_checkpoint(ck2, plain, plain.cfg, TCFG)
    assert main([str(ck2), *base[1:]]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert [p["tau"] for p in ref["per_prompt"]] == [p["tau"] for p in got["0"]["per_prompt"]]
