"""The ``"resblock"`` variant (:mod:`dflash.model.resblock`): a variant declared by one registry entry
and its own files, trained, decoded, exported and loaded through the paths every variant shares."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from dflash.eval.decode import greedy_decode, speculative_decode
from dflash.eval.proposers import CachedDrafterProposer, DrafterProposer
from dflash.eval.static_drafter import static_proposer
from dflash.messages import LossInput
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss
from tests.dflash.run.test_run_e2e import ROOT, cache_dir, small  # noqa: F401 - cache_dir is a fixture

pytestmark = pytest.mark.timeout(600)

BS, V = 4, 128


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V), "cpu", num_draft_layers=2)


def _cfg(target, variant="resblock"):
    return DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1,
                         variant=variant).resolve(target.hf_config, target.layer_ids)


def _batch(target, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (2, 40), generator=g)
    pos = torch.arange(40)[None].expand(2, 40)
    doc, lm = torch.zeros(2, 40, dtype=torch.int32), torch.ones(2, 40, dtype=torch.bool)
    with torch.no_grad():
        feats, final = target(ids, pos, doc)
    return LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                     anchors=sample_anchors(lm, doc, 12, BS, g), final_hidden=final)


def _randomised(d: DFlashDrafter) -> DFlashDrafter:
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in d.output_block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return d.eval()


def test_a_fresh_resblock_drafter_is_the_dflash_drafter_of_its_seed_and_its_block_trains(target):
    """Invariant: zero-initialised, the block is the identity, so a fresh drafter's loss equals the
    DFlash drafter's of the same seed to the bit; one backward reaches the block's weight and bias."""
    head, x = target.shared_head(), _batch(target)
    plain = DFlashDrafter(_cfg(target, "dflash"), seed=2)
    rb = DFlashDrafter(_cfg(target), seed=2)
    assert sorted(set(rb.state_dict()) - set(plain.state_dict())) == ["output_block.linear.bias",
                                                                      "output_block.linear.weight"]
    cfg = LossConfig(label="target_argmax")
    want, got = compute_loss(plain, head, x, cfg).loss, compute_loss(rb, head, x, cfg).loss
    assert torch.equal(got, want)
    got.backward()
    assert rb.output_block.linear.weight.grad.abs().sum() > 0 and rb.output_block.linear.bias.grad.abs().sum() > 0


def test_every_decode_path_drafts_through_the_block_and_stays_lossless(target):
    """Invariant: the recomputing, the cached and the static (CPU, no graph) proposers draft the
    same logits as the training forward, which the block changes; decoding gives the target's greedy
    text with each, the same acceptances."""
    head = target.shared_head()
    d = _randomised(DFlashDrafter(_cfg(target), seed=2))
    n = 9
    tokens = torch.randint(0, V - 1, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats, _ = target(tokens[None], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.int32))
        ctx = feats[:, : n - 1]
        want = DrafterProposer(d, head).logits(tokens, ctx)
        plain = msgspec.structs.replace(d.cfg, variant="dflash")
        without = DFlashDrafter(plain, seed=2).eval()
        without.load_state_dict({k: v for k, v in d.state_dict().items() if not k.startswith("output_block.")})
        assert not torch.allclose(DrafterProposer(without, head).logits(tokens, ctx), want)
        torch.testing.assert_close(CachedDrafterProposer(d, head).logits(tokens, ctx), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static_proposer(d, head, graphs=False).logits(tokens, ctx), want,
                                   rtol=1e-5, atol=1e-5)
        prompt = tokens[:5]
        ref = greedy_decode(target, prompt, 20)
        runs = [speculative_decode(target, p, prompt, 20, BS)
                for p in (DrafterProposer(d, head), CachedDrafterProposer(d, head), static_proposer(d, head, graphs=False))]
    assert all(torch.equal(out, ref) for out, *_ in runs)
    assert runs[0][1] == runs[1][1] == runs[2][1]


def test_a_resblock_run_trains_exports_and_decodes_through_automodel(tmp_path, cache_dir, capsys):  # noqa: F811
    """End to end on the default graph: ``dflash.run`` with ``drafter.variant = "resblock"`` trains
    the block (its weight leaves zero), ``dflash.export`` writes ``DFlashResBlockDraftModel`` with
    its own model file beside ``modeling_dflash.py``, :func:`dflash.export.load_exported` reads it
    back to the same weights, and ``AutoModel`` (trust_remote_code) decodes the shipped target's own
    greedy text with it."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForCausalLM

    from dflash.export import load_exported
    from dflash.export.cli import main as export_main
    from dflash.run.cli import main as run_main

    run = tmp_path / "run"
    assert run_main(small(run, cache_dir, 'drafter.variant="resblock"', steps=8)) == 0
    out = tmp_path / "export"
    assert export_main([str(run / "checkpoints" / "step_00000008"), "-o", str(out), "--dtype", "float32"]) == 0
    capsys.readouterr()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashResBlockDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "modeling_resblock.DFlashResBlockDraftModel"}
    assert (out / "modeling_resblock.py").is_file() and (out / "modeling_dflash.py").is_file()
    card = (out / "README.md").read_text()
    assert "## ResBlock" in card and "A DFlash+ResBlock block drafter (" in card
    weights = load_file(str(out / "model.safetensors"))
    assert weights["output_block.linear.weight"].abs().sum() > 0  # trained away from its zero start

    ours, dc = load_exported(out)
    assert dc.variant == "resblock"
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in weights.items())

    drafter = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(drafter).__name__ == "DFlashResBlockDraftModel"
    assert torch.equal(drafter.output_block.linear.weight, weights["output_block.linear.weight"])
    shipped = ROOT / "dflash" / "assets" / "target-sharegpt-7m"
    target = AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).eval()
    prompt = torch.randint(5, 400, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = target.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    got = drafter.spec_generate(target, prompt, max_new_tokens=24, stop_token_ids=None)
    assert torch.equal(got, want)
