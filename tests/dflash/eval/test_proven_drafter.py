"""A drafter trained against a real (trained) target speeds decoding up, measured, on a CPU.

The target is trained here, in seconds, on a small learnable synthetic language: sentences are
random sequences of 10 fixed "words" of 3-5 tokens, so inside a word the next token is determined
and only word starts are uncertain. It is saved as a local Hugging Face directory and loaded through
``[target].path`` like any real Qwen3 checkpoint. A drafter trained on its features with the
project's loss (``dflash.train.objective.compute_loss``, target-argmax labels) must then draft whole word
tails: the measured tau (tokens per verify step) is clearly above 1, and draft-and-verify output is
exactly the target's own greedy output.
"""

from __future__ import annotations

import pytest
import torch

from dflash.eval.decode import greedy_decode
from dflash.eval.measure import evaluate
from dflash.messages import LossInput
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from dflash.train.anchors import sample_anchors
from dflash.train.loss import LossConfig
from dflash.train.objective import compute_loss

# ~15 s on 2 idle cores (two small trainings); the margin is for a loaded machine
pytestmark = pytest.mark.timeout(300)

V, BS, T = 48, 4, 64
WORDS = [[4 + (7 * w + 3 * i) % (V - 4) for i in range(3 + w % 3)] for w in range(10)]


def sentences(n: int, seed: int) -> torch.Tensor:
    """``[n, T]`` token rows: random words back to back (deterministic within a word)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        row: list[int] = []
        while len(row) < T:
            row += WORDS[int(torch.randint(len(WORDS), (1,), generator=g))]
        rows.append(row[:T])
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def trained_target(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = sentences(256, seed=1)
    for step in range(120):
        x = data[(step * 32) % 256: (step * 32) % 256 + 32]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("synthetic-target")
    model.save_pretrained(path)
    return load_target(TargetConfig(path=str(path), dtype="float32"), "cpu", num_draft_layers=1,
                       need_final=True), float(loss.detach())


def test_drafter_trained_on_a_real_target_is_accepted_and_lossless(trained_target):
    """Invariant (the product works): a drafter trained for a bounded number of steps against a
    trained target reaches a measured tau clearly above 1 on prompts it never saw, and
    speculative decoding with it returns exactly the target's greedy tokens."""
    target, target_loss = trained_target
    assert target_loss < 1.2                    # it learned the words (uniform would be ln 48 = 3.9)
    head = target.shared_head()
    dc = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=3).resolve(target.hf_config,
                                                                            target.layer_ids)
    drafter = DFlashDrafter(dc, seed=0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    loss_cfg = LossConfig(label="target_argmax", weighting="none")
    data = sentences(128, seed=2)
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(T)[None].expand(16, T)
    doc = torch.zeros(16, T, dtype=torch.long)
    mask = torch.ones(16, T, dtype=torch.bool)
    for step in range(150):
        x = data[(step * 16) % 128: (step * 16) % 128 + 16]
        with torch.no_grad():
            feats, final = target(x, pos, doc, need_final=True)
        anchors = sample_anchors(mask, doc, 16, BS, gen)
        inp = LossInput(features=feats, input_ids=x, loss_mask=mask, doc_ids=doc, position_ids=pos,
                        anchors=anchors, final_hidden=final)
        out = compute_loss(drafter, head, inp, loss_cfg)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    drafter.eval()
    prompts = [row[:12] for row in sentences(4, seed=99)]   # held out: another seed
    res = evaluate(target, drafter, head, prompts, max_new_tokens=40)
    assert res.tau > 1.8, res                   # clearly above plain decoding's 1 token per step
    assert res.tau == pytest.approx(res.mean_accepted + 1)
    assert abs(res.streak_visited - res.mean_accepted) < 0.05
    for p in prompts:                            # lossless: the same tokens as greedy decoding
        from dflash.eval.decode import CachedDrafterProposer, speculative_decode

        out, _, _ = speculative_decode(target, CachedDrafterProposer(drafter, head), p, 40, BS)
        assert torch.equal(out, greedy_decode(target, p, 40))
