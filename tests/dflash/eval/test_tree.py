"""Tree verification, teacher-forced (:mod:`dflash.eval.tree`), against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash.eval.tree import tree_accepted


def _brute(logits, labels, valid, budget):
    """Every prefix of every length scored by its summed log-probabilities; the ``budget`` best
    form the tree; the longest valid label prefix among them."""
    logp = torch.log_softmax(logits.double(), -1)
    out = []
    for a in range(logits.shape[0]):
        S, V = logits.shape[1:]
        prefixes = [p for d in range(1, S + 1) for p in itertools.product(range(V), repeat=d)]
        prefixes.sort(key=lambda p: -sum(float(logp[a, j, t]) for j, t in enumerate(p)))
        tree = set(prefixes[:budget])
        n = int(valid[a].long().cumprod(0).sum())
        lab = tuple(labels[a].tolist())
        out.append(max([d for d in range(1, n + 1) if lab[:d] in tree], default=0))
    return out


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 20])
def test_the_best_first_tree_is_the_budget_most_probable_prefixes(budget):
    g = torch.Generator().manual_seed(budget)
    logits = torch.randn(12, 3, 4, generator=g) * 2
    labels = torch.randint(0, 4, (12, 3), generator=g)
    labels[:4] = logits[:4].argmax(-1)                       # some blocks the chain gets right
    valid = torch.ones(12, 3, dtype=torch.bool)
    valid[5, 2] = valid[6, 1:] = False                      # the text ends inside two blocks
    assert tree_accepted(logits, labels, valid, budget).tolist() == _brute(logits, labels, valid, budget)


def test_a_tree_holding_every_prefix_accepts_every_valid_label():
    logits = torch.randn(3, 2, 3)
    labels = torch.zeros(3, 2, dtype=torch.long)
    valid = torch.tensor([[True, True], [True, False], [False, False]])
    assert tree_accepted(logits, labels, valid, budget=3 + 9).tolist() == [2, 1, 0]


def test_a_budget_below_one_or_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        tree_accepted(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="same blocks"):
        tree_accepted(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), 4)


def test_dflash_eval_reports_the_tree_figure_and_it_grows_with_the_budget(tmp_path, capsys):
    """``--tree-budget B`` adds the teacher-forced tree row and ``tree_tau`` to ``--json``; a larger
    tree holds every prefix of a smaller one, so tau never falls as B grows; budget 1 accepts at
    most the first position; a negative budget is one line, exit 2."""
    import json

    from tests.helpers import save_checkpoint
    from dflash.eval.cli import main as eval_main
    from tests.dflash.export.test_export import TCFG, make

    d = make()
    save_checkpoint(tmp_path, d, d.cfg, TCFG)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "what is two plus two?"}\n')
    base = [str(tmp_path), "--prompts", str(prompts), "--max-new-tokens", "12", "--device", "cpu", "--no-speedup"]
    taus = []
    for budget in (1, 4, 64):
        assert eval_main([*base, "--tree-budget", str(budget), "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["tree_budget"] == budget and res["tree_seconds"] > 0
        assert 1.0 <= res["tree_tau"] <= res["block_size"]
        taus.append(res["tree_tau_tf"])
    assert 1.0 <= taus[0] <= 2.0 and taus[0] <= taus[1] <= taus[2] <= res["block_size"]
    assert eval_main([*base, "--tree-budget", "4"]) == 0
    out = capsys.readouterr().out
    assert "teacher-forced tree of 4 @ all anchors" in out and "measured: tree-verified decode (4 nodes)" in out
    assert eval_main([*base, "--tree-budget", "4", "--temperature", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 1.0 <= res["sampled_tree_tau"] <= res["block_size"] and res["sampled_tau"] is not None
    assert eval_main([*base, "--tree-budget", "4", "--temperature", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line[:44].strip() for line in lines if line.startswith("measured")]
    assert names == ["measured: draft-and-verify decode", "measured: sampled (T=1)",
                     "measured: tree-verified decode (4 nodes)", "measured: sampled tree (4 nodes, T=1)"]
    with pytest.raises(SystemExit) as stop:  # argparse's error: usage, then the one line
        eval_main([*base, "--tree-budget", "-1"])
    assert stop.value.code == 2 and "--tree-budget must be >= 0" in capsys.readouterr().err


def _fit(variant: str):
    """A tiny target and a drafter of ``variant`` briefly fit to its greedy continuations, so that
    trees are accepted in part (a random drafter is accepted almost never)."""
    from dflash.messages import LossInput
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import TargetConfig, load_target
    from dflash.train.anchors import sample_anchors
    from dflash.train.loss import LossConfig
    from dflash.train.objective import compute_loss

    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=64), "cpu", num_draft_layers=2)
    head = target.shared_head()
    d = DFlashDrafter(DrafterConfig(variant=variant, num_layers=1, block_size=4, mask_token_id=63).resolve(
        target.hf_config, target.layer_ids), seed=2)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        ids = torch.randint(0, 63, (4, 40), generator=g)
        pos = torch.arange(40)[None].expand(4, 40)
        doc, lm = torch.zeros(4, 40, dtype=torch.int32), torch.ones(4, 40, dtype=torch.bool)
        with torch.no_grad():
            feats, final = target(ids, pos, doc)
        x = LossInput(features=feats, input_ids=ids, loss_mask=lm, doc_ids=doc, position_ids=pos,
                      anchors=sample_anchors(lm, doc, 16, 4, g), final_hidden=final)
        compute_loss(d, head, x, LossConfig(label="target_argmax", weighting="none")).loss.backward()
        opt.step()
        opt.zero_grad()
    return target, head, d.eval()


@pytest.fixture(scope="module")
def tiny():
    return _fit("dflash")


@pytest.mark.parametrize("budget", [1, 3, 12])
def test_tree_decoding_is_the_targets_greedy_text_and_accepts_what_the_tree_figure_says(tiny, budget):
    """Invariant: greedy tree-verified decoding returns the target's own greedy text, with the
    recomputing and the cached drafter alike; at every anchor it verified, its accepted length
    equals the teacher-forced tree figure of the same budget on that text."""
    from dflash.eval.decode import greedy_decode
    from dflash.eval.measure import _teacher_forced_blocks
    from dflash.eval.proposers import CachedDrafterProposer, DrafterProposer
    from dflash.eval.tree_decode import tree_decode

    target, head, d = tiny
    seen = 0
    for seed in range(3):
        prompt = torch.randint(0, 63, (7,), generator=torch.Generator().manual_seed(seed))
        want = greedy_decode(target, prompt, 24)
        out, acc, anchors = tree_decode(target, CachedDrafterProposer(d, head), prompt, 24, 4, budget)
        again, acc2, _ = tree_decode(target, DrafterProposer(d, head), prompt, 24, 4, budget)
        assert torch.equal(out, want) and torch.equal(again, want) and acc == acc2
        with torch.no_grad():
            hidden, labels, valid = _teacher_forced_blocks(target, d, head, out, torch.tensor(anchors))
            figure = tree_accepted(head.logits(hidden[:, 1:]), labels, valid, budget)
        # the last step may draft fewer positions than the block holds (the end of the text)
        assert acc[:-1] == figure.tolist()[:-1]
        seen += sum(acc)
    assert seen > 0  # trees were accepted in part: the paths beyond the first node were exercised


def test_a_dflash2_tree_is_its_backbones_and_decodes_the_targets_greedy_text():
    """Invariant: a DFlash2 drafter's tree (its backbone's marginals, where the selector takes its
    candidates from) decodes the target's greedy text through both selector proposers, and at every
    anchor accepts what the teacher-forced tree figure of its backbone says."""
    from dflash.eval.decode import greedy_decode
    from dflash.eval.measure import _teacher_forced_blocks, tree_proposer_factory
    from dflash.eval.selector import SelectorProposer
    from dflash.eval.tree_decode import tree_decode

    target, head, d = _fit("dflash2")
    seen = 0
    for seed in range(3):
        prompt = torch.randint(0, 63, (7,), generator=torch.Generator().manual_seed(seed))
        want = greedy_decode(target, prompt, 24)
        out, acc, anchors = tree_decode(target, tree_proposer_factory(d, head)(), prompt, 24, 4, 6)
        again, acc2, _ = tree_decode(target, SelectorProposer(d, head), prompt, 24, 4, 6)
        assert torch.equal(out, want) and torch.equal(again, want) and acc == acc2
        with torch.no_grad():
            hidden, labels, valid = _teacher_forced_blocks(target, d, head, out, torch.tensor(anchors))
            figure = tree_accepted(head.logits(hidden[:, 1:]), labels, valid, 6)
        assert acc[:-1] == figure.tolist()[:-1]
        seen += sum(acc)
    assert seen > 0


def test_xpress_has_no_tree_proposer():
    from dflash.eval.measure import tree_proposer_factory
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import TargetConfig, load_target

    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=64), "cpu", num_draft_layers=2)
    d = DFlashDrafter(DrafterConfig(variant="xpress", num_layers=1, block_size=4, mask_token_id=63).resolve(
        target.hf_config, target.layer_ids), seed=2)
    assert tree_proposer_factory(d, target.shared_head()) is None


class _Peaked:
    """Drafter-shaped logits peaked on the target's greedy continuation (a tree that holds it and, at
    this budget, alternatives at the first position): a sampled walk then accepts 0, 1 or 2 nodes."""

    def __init__(self, target, bs):
        from dflash.eval.decode import OracleProposer

        self.oracle, self.V = OracleProposer(target, bs), target.hf_config.vocab_size

    def logits(self, tokens, features):
        greedy = self.oracle.propose(tokens, features)
        out = torch.zeros(greedy.shape[0], self.V)
        out[torch.arange(greedy.shape[0]), greedy] = 3.0
        return out


def _tree_counts(target, prompt, cells, budget, runs=600):
    from dflash.eval.tree_decode import tree_decode
    from tests.dflash.eval.test_decode_loop import T, TOP_K

    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(cells) + 1)             # the last cell: outside the target's support
    index = {c: i for i, c in enumerate(cells)}
    firsts = set()
    for _ in range(runs):
        out, acc, _ = tree_decode(target, _Peaked(target, 4), prompt, 3, 4, budget, temperature=T,
                                  top_k=TOP_K, generator=gen)
        counts[index.get(tuple(out[prompt.shape[0]:].tolist()), len(cells))] += 1
        firsts.add(acc[0])
    return counts, firsts


def test_sampled_tree_decoding_is_distributed_as_the_target_samples(tiny, monkeypatch):
    """Invariant (lossless): the first 3 tokens of sampled tree-verified decoding (one from the
    prefill, two from a tree step that accepts 0, 1 or 2 nodes) follow the target's own processed
    distribution, by the chi-square test at 1e-3 that rejects a wrong walk (the most likely token in
    place of each draw)."""
    from dflash.eval import tree_decode as td
    from tests.dflash.eval.test_decode_loop import ALPHA, _chi_square_pvalue, _exact_joint

    target = tiny[0]
    prompt = torch.randint(0, 63, (6,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = _exact_joint(target, prompt, 3)
    cells = sorted(exact)
    probs = torch.tensor([exact[c] for c in cells] + [0.0])
    counts, firsts = _tree_counts(target, prompt, cells, budget=6)
    assert firsts == {0, 1, 2}                       # rejection at the root, one node accepted, both
    good = _chi_square_pvalue(counts, probs)
    print(f"chi-square p-value: tree walk {good:.3g}", end="; ")
    assert good > ALPHA

    def most_likely(probs, n, generator=None):  # a wrong draw: p's most likely token, not a draw from p
        return probs.argmax(-1, keepdim=True)

    with monkeypatch.context() as m:
        m.setattr(td.torch, "multinomial", most_likely)
        wrong, _ = _tree_counts(target, prompt, cells, budget=6, runs=200)
    bad = _chi_square_pvalue(wrong, probs)
    print(f"argmax in place of a draw {bad:.3g}")
    assert bad < ALPHA


def test_sampled_tree_decoding_is_reproducible_and_refuses_bad_parameters(tiny):
    from dflash.eval.proposers import CachedDrafterProposer
    from dflash.eval.tree_decode import tree_decode

    target, head, d = tiny
    prompt = torch.randint(0, 63, (7,), generator=torch.Generator().manual_seed(3))
    a = tree_decode(target, CachedDrafterProposer(d, head), prompt, 16, 4, 8, temperature=1.0,
                    generator=torch.Generator().manual_seed(5))
    b = tree_decode(target, CachedDrafterProposer(d, head), prompt, 16, 4, 8, temperature=1.0,
                    generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    with pytest.raises(ValueError, match="sampling needs"):
        tree_decode(target, CachedDrafterProposer(d, head), prompt, 16, 4, 8, temperature=-1.0)
