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
        assert res["tree_budget"] == budget
        taus.append(res["tree_tau"])
    assert 1.0 <= taus[0] <= 2.0 and taus[0] <= taus[1] <= taus[2] <= res["block_size"]
    assert eval_main([*base, "--tree-budget", "4"]) == 0
    assert "teacher-forced tree of 4 @ all anchors" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # argparse's error: usage, then the one line
        eval_main([*base, "--tree-budget", "-1"])
    assert stop.value.code == 2 and "--tree-budget must be >= 0" in capsys.readouterr().err
