"""Train at one block size, serve at a smaller one (``dflash.eval --block-size``): a drafter served
at block ``n`` computes what a drafter built at ``n`` with the same weights computes, the decode
stays lossless, and sizes it never trained on are refused."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dflash.eval.decode import greedy_decode, speculative_decode
from dflash.eval.measure import evaluate
from dflash.eval.proposers import CachedDrafterProposer
from dflash.eval.selector import selector_proposer
from dflash.model.attention import decode_layout
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target

pytestmark = pytest.mark.timeout(300)

TRAINED, V = 8, 128


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V), "cpu", num_draft_layers=2)


def _drafter(target, variant, block_size=TRAINED):
    cfg = DrafterConfig(num_layers=2, block_size=block_size, mask_token_id=V - 1, variant=variant,
                        selector_rank=8, selector_top_k=6).resolve(target.hf_config, target.layer_ids)
    d = DFlashDrafter(cfg, seed=2).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a DFlash2 walk off the argmax, so that the convolution and walk are exercised
        for n, p in d.named_parameters():
            if "conv" in n or "candidate_selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return d


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("n", [4, 2])
def test_served_at_n_computes_what_a_drafter_built_at_n_computes(target, variant, n):
    trained = _drafter(target, variant)
    built = DFlashDrafter(msgspec.structs.replace(trained.cfg, block_size=n)).eval()
    built.load_state_dict(trained.state_dict())
    trained.serve_at_block_size(n)
    assert trained.cfg.block_size == n and trained.trained_block_size == TRAINED
    ids = torch.randint(0, V - 1, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats, _ = target(ids, torch.arange(20)[None], torch.zeros(1, 20, dtype=torch.int32))
        block = torch.full((1, 1, n), V - 1)
        block[0, 0, 0] = ids[0, -1]
        emb = target.shared_head().embed(block)
        layout = decode_layout(19, 19, n, ids.device)
        got, want = trained(feats[:, :19], emb, layout), built(feats[:, :19], emb, layout)
    assert got.shape == (1, 1, n, target.hf_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_decode_at_a_smaller_block_is_lossless_and_drafts_fewer_tokens(target, variant):
    d, head = _drafter(target, variant), target.shared_head()
    d.serve_at_block_size(4)
    make = (lambda: selector_proposer(d, head)) if variant == "dflash2" else (lambda: CachedDrafterProposer(d, head))
    prompt = torch.randint(0, V - 1, (9,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, acc, _ = speculative_decode(target, make(), prompt, 24, d.cfg.block_size)
        ref = greedy_decode(target, prompt, 24)
    assert torch.equal(out, ref)
    assert acc and max(acc) <= 3  # at most block_size - 1 drafts accepted per verify step
    res = evaluate(target, d, head, [prompt], 24, speed=False)
    assert res.block_size == 4 and res.trained_block_size == TRAINED and res.tau <= 4


def test_a_block_size_it_never_trained_on_is_refused(target):
    d = _drafter(target, "dflash")
    for bad in (1, TRAINED + 1):
        with pytest.raises(ValueError, match=f"serve this drafter at 2 .. {TRAINED} tokens per block"):
            d.serve_at_block_size(bad)
    assert d.cfg.block_size == TRAINED  # refused: nothing changed
