"""An export decodes in z-lab's ``dflash_generate`` loop through ``AutoModel`` alone.

z-lab's package is not a dependency: the test imports it from ``ZLAB_DFLASH_PATH`` (a directory
holding the ``zlab_dflash`` package, i.e. z-lab's ``dflash`` package renamed so it does not shadow
ours) through :func:`tests.zlab.zlab_model`, and is skipped, with that reason, when the variable is
unset.
"""

from __future__ import annotations

import time

import pytest
import torch

from dflash.export import export_drafter
from dflash.model.target import load_target
from tests.dflash.export.test_export import ABOUT, TCFG, make
from tests.zlab import zlab_model


@pytest.fixture(scope="module")
def zl():
    return zlab_model()


def _recorded(model, calls: list):
    """Wrap ``model.compute_logits`` to record the draft hidden states it is given."""
    inner = model.compute_logits

    def compute_logits(hidden, head):
        calls.append(hidden.detach().clone())
        return inner(hidden, head)

    model.compute_logits = compute_logits
    return model


@pytest.mark.filterwarnings("ignore::FutureWarning")  # z-lab passes past_key_values (renamed in transformers 5.2x)
@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"]])
def test_automodel_export_decodes_in_zlab_dflash_generate_like_zlab_own_class(tmp_path, zl, types, monkeypatch):
    """Invariant: ``dflash_generate(AutoModel.from_pretrained(export, trust_remote_code=True),
    target, ...)`` runs (block_size, mask_token_id, target_layer_ids, compute_logits, the draft KV
    cache and the tensor return are what z-lab's loop reads), is lossless (the target's own greedy
    text), and gives the same per-step accepted lengths and draft hidden states as z-lab's
    ``DFlashDraftModel.from_pretrained(export)`` (full and sliding-window drafter layers)."""
    from transformers import AutoModel

    out = tmp_path / "export"
    export_drafter(make(types), out, torch.float32, about=ABOUT)  # dflash_target, dflash_eval: ignored
    target = load_target(TCFG, "cpu", 2).model.float()
    # An LM head that scores token 7 by one random direction of the hidden state and every other token 0, so
    # target and drafter agree often and the accepted lengths vary (a random drafter gets 1s only).
    head = torch.zeros_like(target.lm_head.weight)
    head[7] = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(5))
    target.lm_head.weight = torch.nn.Parameter(head)
    ours = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(ours).__module__.endswith("modeling_dflash")
    theirs = zl.DFlashDraftModel.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours_calls, theirs_calls = [], []
    _recorded(ours, ours_calls)
    _recorded(theirs, theirs_calls)

    prompt = torch.randint(5, 4000, (1, 11), generator=torch.Generator().manual_seed(2))
    kw = {"input_ids": prompt, "max_new_tokens": 40, "stop_token_ids": None, "return_stats": True}
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)  # the loop's timer synchronises CUDA
    got = zl.dflash_generate(ours, target, **kw)
    want = zl.dflash_generate(theirs, target, **kw)
    with torch.no_grad():
        greedy = target.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)

    assert got.acceptance_lengths == want.acceptance_lengths
    assert len(set(got.acceptance_lengths)) > 1  # some blocks accepted in part, some in full
    assert torch.equal(got.output_ids, want.output_ids)
    assert torch.equal(got.output_ids[0, : greedy.shape[1]], greedy[0])
    assert len(ours_calls) == len(theirs_calls) > 3
    for a, b in zip(ours_calls, theirs_calls):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
