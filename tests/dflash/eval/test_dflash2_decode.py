"""Decoding with a DFlash2 drafter: the selector's walk drafts, the output is the target's greedy
output, the drafts are what teacher-forced training computes, dflash.eval reports recall@K and
oracle top-K tau, and per verify step the accepted lengths are z-lab's ``dflash_generate``'s."""

from __future__ import annotations

import time

import pytest
import torch

from dflash.eval.decode import greedy_decode, speculative_decode
from dflash.eval.measure import evaluate
from dflash.eval.report import format_result
from dflash.eval.selector import CachedSelectorProposer, SelectorProposer, selector_proposer
from dflash.export import export_drafter, load_exported
from dflash.model.attention import training_layout
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from tests.zlab import zlab_model

pytestmark = pytest.mark.timeout(300)

BS, V = 4, 128


@pytest.fixture(scope="module")
def models():
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V), "cpu", num_draft_layers=2)
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1, variant="dflash2", selector_rank=8,
                        selector_top_k=6).resolve(target.hf_config, target.layer_ids)
    d = DFlashDrafter(cfg, seed=2).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # move the walk off the argmax, so that it is what is tested
        for n, p in d.named_parameters():
            if "conv" in n or "candidate_selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "base_kernel" in n else 0.5))
    return target, head, d


@pytest.fixture(scope="module")
def trained(models):
    """A DFlash2 drafter trained briefly on the target's greedy labels (random token rows), so
    that its drafts are accepted sometimes and not always: accepted lengths vary."""
    from dflash.messages import LossInput
    from dflash.train.anchors import sample_anchors
    from dflash.train.loss import LossConfig
    from dflash.train.objective import compute_loss

    target, head, _ = models
    cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1, variant="dflash2", selector_rank=8,
                        selector_top_k=6).resolve(target.hf_config, target.layer_ids)
    d = DFlashDrafter(cfg, seed=2)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        ids = torch.randint(0, V - 1, (4, 48), generator=g)
        pos = torch.arange(48)[None].expand(4, 48)
        doc, lm = torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 48, dtype=torch.bool)
        feats, final = target(ids, pos, doc)
        x = LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                      anchors=sample_anchors(lm, doc, 16, BS, g), final_hidden=final)
        compute_loss(d, head, x, LossConfig(label="target_argmax", weighting="none")).loss.backward()
        opt.step()
        opt.zero_grad()
    return d.eval()


def prompt(seed, n=9):
    return torch.randint(0, V - 1, (n,), generator=torch.Generator().manual_seed(seed))


class Recorder:
    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def propose(self, tokens, features):
        out = self.inner.propose(tokens, features)
        self.drafts.append(out.clone())
        return out


def test_selector_decode_is_lossless_and_drafts_the_teacher_forced_walk(models):
    """Invariant (train/inference consistency): the output equals plain greedy decoding, and every
    block drafted equals the walk over the block teacher-forced training computes at the same
    anchor (the convolution sees one block either way); the walk differs from the argmax."""
    target, head, d = models
    p = prompt(1)
    rec = Recorder(SelectorProposer(d, head))
    tokens, accepted, anchors = speculative_decode(target, rec, p, 14, BS)
    assert torch.equal(tokens, greedy_decode(target, p, 14))
    L = tokens.shape[0]
    pos = torch.arange(L)[None]
    feats, _ = target(tokens[None], pos, torch.zeros_like(pos), need_final=False)
    a = torch.tensor([anchors])
    block = torch.full((1, len(anchors), BS), V - 1)
    block[0, :, 0] = tokens[a[0]]
    sel = d.candidate_selector
    with torch.no_grad():
        hid = d(feats, head.embed(block), training_layout(pos, torch.zeros_like(pos), a, BS))[0, :, 1:]
        unary, cand = sel.candidates(head.logits(hid))
        walk, _ = sel.walk(hid, unary, cand, tokens[a[0]])
    assert torch.equal(walk, torch.stack(rec.drafts))
    assert not torch.equal(walk, head.logits(hid).argmax(-1))


def test_cached_selector_proposes_what_the_uncached_one_does(models):
    """Invariant: the drafter's context KV cache changes speed, not drafts: at every step the
    cached DFlash2 proposer's block equals the recomputing one's (the convolutions see only the
    block either way)."""
    target, head, d = models
    p = prompt(5)
    plain, cached = Recorder(SelectorProposer(d, head)), Recorder(CachedSelectorProposer(d, head))
    tokens, _, _ = speculative_decode(target, plain, p, 14, BS)
    tokens_c, _, _ = speculative_decode(target, cached, p, 14, BS)
    assert torch.equal(tokens, tokens_c) and len(plain.drafts) == len(cached.drafts) > 2
    assert all(torch.equal(a, b) for a, b in zip(plain.drafts, cached.drafts))
    with pytest.raises(ValueError, match="needs a DFlash2 drafter"):
        cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1)
        CachedSelectorProposer(DFlashDrafter(cfg.resolve(target.hf_config, target.layer_ids)), head)


def test_evaluate_reports_the_walk_with_recall_and_oracle(models):
    """dflash.eval on a DFlash2 drafter: measured tau is the walk's (its teacher-forced streak at
    the visited anchors equals it), and recall@K, oracle top-K tau and the backbone top-1's tau
    come beside it, printed in the table; the oracle bounds the walk."""
    target, head, d = models
    res = evaluate(target, d, head, [prompt(3), prompt(4, 6)], max_new_tokens=10)
    sel = res.selector
    assert sel is not None and sel.top_k == 6 and 0 <= sel.recall <= 1
    assert res.streak_visited == pytest.approx(res.mean_accepted)
    assert sel.oracle_tau >= res.streak_all + 1 and sel.oracle_tau >= sel.backbone_tau
    text = format_result(res)
    assert "oracle top-6" in text and "recall@6" in text and "backbone top-1 streak" in text
    assert "walk reached j, label in top-6, picked" in text and len(sel.reached_pick_per_pos) == BS - 1


# z-lab's decoder passes past_key_values, which transformers 5.24 renames (removal in 5.40)
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("types", [None, ["sliding_attention"]])
def test_accepted_lengths_equal_zlab_dflash_generate(models, trained, tmp_path, monkeypatch, types):
    """Invariant (we measure what the reference decoder measures): on the same export and the same
    random target, every verify step accepts as many tokens as z-lab's dflash_generate (its
    ``acceptance_lengths`` count the bonus token and stop at the output's end, so ours compare as
    ``min(m + 1, remaining)``), and both outputs are the target's greedy output. The last step is
    compared only when its block is full: z-lab shortens the final block, which changes what its
    bidirectional block attention sees."""
    zl = zlab_model()
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)   # return_stats synchronises CUDA otherwise
    target, head, _ = models
    d = trained
    if types is not None:
        cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1, variant="dflash2",
                            selector_rank=8, selector_top_k=6, layer_types=types, sliding_window=8)
        d2 = DFlashDrafter(cfg.resolve(target.hf_config, target.layer_ids), seed=2)
        d2.load_state_dict(d.state_dict())
        d = d2.eval()
    export_drafter(d, tmp_path, torch.float32)
    ours, _ = load_exported(tmp_path)
    zmodel = zl.DFlash2DraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    for seed, new in ((5, 23), (6, 30)):
        p = prompt(seed, 11)
        tokens, accepted, anchors = speculative_decode(target, selector_proposer(ours, head), p, new, BS)
        ref = zl.dflash_generate(zmodel, target.model, p[None], new, None, return_stats=True)
        assert torch.equal(ref.output_ids[0], tokens) and torch.equal(tokens, greedy_decode(target, p, new))
        full = [(m, p.shape[0] + new - 1 - a) for m, a in zip(accepted, anchors)]   # (m, remaining)
        full = [min(m + 1, rem) for m, rem in full if rem >= BS - 1]
        assert ref.acceptance_lengths[:len(full)] == full and len(full) >= 5
        assert len(set(full)) > 1          # the walk is sometimes rejected: lengths vary


def test_a_dflash2_run_trains_evaluates_and_exports(tmp_path, capsys):
    """End to end on the default graph with drafter.variant = "dflash2": python -m dflash.run
    trains and checkpoints it (metrics.jsonl carries the selector's figures), python -m dflash.eval
    decodes its checkpoint with the walk and prints recall@K and oracle top-K tau beside measured
    tau, and python -m dflash.export writes the DFlash2 layout."""
    import json

    from dflash.eval.cli import main as eval_main
    from dflash.export import main as export_main
    from dflash.run.cli import main as run_main
    from tests.dflash.run.test_run_e2e import records, small

    run = tmp_path / "run"
    assert run_main(small(run, tmp_path / "cache", 'drafter.variant="dflash2"', "drafter.selector_rank=16",
                          steps=4)) == 0
    train = records(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all({"sel_loss", "sel_acc", "sel_tau", "base_tau", "recall_k", "oracle_tau", "label_missing"} <= r.keys()
               for r in train)
    ckpt = run / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "drafter_config.json").read_text())["variant"] == "dflash2"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello, how are you?"}\n')
    capsys.readouterr()
    assert eval_main([str(ckpt), "--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "12",
                      "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "measured: draft-and-verify decode" in out and "recall@16" in out and "oracle top-16" in out
    assert export_main([str(ckpt), "-o", str(tmp_path / "export")]) == 0
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_rank"] == 16


def test_where_the_walk_loses_its_tokens_per_position():
    """Among blocks whose walk was right up to j - 1: the share with the label in the top-K, and
    among those the share the walk picks; counted by hand on three blocks."""
    from types import SimpleNamespace

    from dflash.eval.selector import selector_figures

    T, F = True, False
    hit = torch.tensor([[T, T, F], [T, F, F], [F, F, F]])
    in_k = torch.tensor([[T, T, T], [T, T, F], [F, T, T]])
    valid = torch.tensor([[T, T, T], [T, T, T], [T, T, F]])
    top1 = torch.zeros_like(hit)
    fig = selector_figures(SimpleNamespace(cfg=SimpleNamespace(selector_top_k=4)), [(top1, in_k, valid)], hit)
    # position 1: all 3 reached, 2 with the label in the top-K, both picked
    # position 2: blocks 0 and 1 reached, both in the top-K, block 0 picked
    # position 3: block 0 reached, in the top-K, not picked
    assert fig.reached_in_k_per_pos == pytest.approx([2 / 3, 1.0, 1.0])
    assert fig.reached_pick_per_pos == pytest.approx([1.0, 0.5, 0.0])
