"""The static-shape target step (dflash.eval.static_target): on a CPU the same forward the CUDA
graph replays runs eagerly, and it must compute what transformers' forward with a dynamic KV cache
computes, step by step and through whole decodes, for both families it supports."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from dflash.eval import static_target
from dflash.eval.args import build_parser
from dflash.eval.decode import (CachedDrafterProposer, CachedTarget, DecodeStopped, greedy_decode,
                               speculative_decode)
from dflash.eval.measure import evaluate
from dflash.eval.grouped import format_speed
from dflash.eval.report import format_result
from dflash.eval.selector import selector_proposer
from dflash.eval.static_target import StaticTarget, UnsupportedTarget, acquire, check_supported, release
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.target import TargetConfig, load_target
from tests.sync_probe import SyncProbe

pytestmark = pytest.mark.timeout(300)

BS, V = 4, 96
CUDA = torch.cuda.is_available()


def _llama(root, name: str, rope: dict) -> str:
    """A random-init Llama (GQA 4/2 heads, tied embeddings as SmolLM2) saved as a local HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, rope_parameters=rope)
    torch.manual_seed(0)
    path = root / name
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Qwen3 (q/k norms, the project's preset) and Llama (no q/k norms; default and llama3 RoPE)."""
    root = tmp_path_factory.mktemp("llama")
    default = {"rope_type": "default", "rope_theta": 10_000.0}
    llama3 = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        "qwen3": load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V), "cpu", num_draft_layers=2),
        "llama": load_target(TargetConfig(path=_llama(root, "default", default)), "cpu", num_draft_layers=2),
        "llama3-rope": load_target(TargetConfig(path=_llama(root, "llama3", llama3)), "cpu", num_draft_layers=2),
    }


def prompt(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


@pytest.mark.parametrize("family", ["qwen3", "llama", "llama3-rope"])
def test_static_steps_compute_what_the_dynamic_cache_computes(targets, family):
    """Invariant: per step, the static forward's logits and features (layer outputs in
    Target.collect's order) equal transformers' cached forward in fp32: a prefill, full verify
    steps, a rejected draft whose stale slots are left in the cache and then rewound over, and a
    short last step padded to the width."""
    target = targets[family]
    dyn, static = CachedTarget(target, 64), StaticTarget(target, BS, 64)
    p = prompt(1)
    f_d, l_d = dyn(p, 0, last_only=True)
    f_s, l_s = static(p, 0, last_only=True)
    _close(f_s, f_d)
    _close(l_s, l_d)
    # (start, block length, tokens kept afterwards): 0 kept of a block = every draft rejected
    start = p.shape[0]
    for i, (w, accepted) in enumerate([(BS, BS), (BS, 1), (BS, 2), (BS, 0), (2, 2)]):
        ids = prompt(100 + i, w)
        f_d, l_d = dyn(ids, start)
        f_s, l_s = static(ids, start)
        assert f_s.shape == (1, w, 2 * target.hf_config.hidden_size) and l_s.shape == (w, V)
        _close(f_s, f_d)
        _close(l_s, l_d)
        start += max(accepted, 1)   # the anchor is kept; slots past it hold a rejected draft's keys
        dyn.keep(start)
        static.keep(start)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_captured_step_reads_nothing_back_to_the_host(targets, family):
    """Invariant (what makes the step capturable as a CUDA graph): the fixed-shape step, inputs
    copied into the static buffers included, has no op that waits for the device (a value read, or
    an op whose output shape depends on values), whatever the positions; checked on CPU tensors."""
    run = StaticTarget(targets[family], BS, 64)
    run(prompt(3), 0)
    with SyncProbe() as probe:
        for start, w in [(9, BS), (10, BS), (11, 2)]:
            run(prompt(start, w), start)
    assert probe.syncs == []


class _Spoiled:
    """Drafts the target's own greedy continuation with one slot per block wrong, the slot moving
    from step to step, so accepted lengths range over 0 .. bs-1 (with rewinds in between)."""

    def __init__(self, text: torch.Tensor) -> None:
        self.text, self.step = text, 0

    def propose(self, tokens, features):
        n = tokens.shape[0]
        draft = self.text[n:n + BS - 1].clone()
        k = self.step % BS                     # k == BS - 1: nothing spoiled, every draft accepted
        if k < draft.shape[0]:
            draft[k] = (draft[k] + 1) % V
        self.step += 1
        return draft


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decodes_are_token_identical_with_the_static_step(targets, family):
    """Invariant: cuda_graphs=True changes how the target runs, not what it decodes: greedy
    decoding and draft-and-verify (varied acceptance; a real drafter reading the features) give
    the dynamic path's tokens and accepted lengths in fp32."""
    target = targets[family]
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1).resolve(target.hf_config,
                                                                                  target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=3).eval()
    for seed, n in [(1, 9), (2, 3), (3, 17)]:
        p = prompt(seed, n)
        ref = greedy_decode(target, p, 30)
        assert torch.equal(greedy_decode(target, p, 30, cuda_graphs=True), ref)
        text = greedy_decode(target, p, 30 + BS)
        for make in (lambda: _Spoiled(text), lambda: CachedDrafterProposer(drafter, head)):
            out, acc, anchors = speculative_decode(target, make(), p, 30, BS)
            out_s, acc_s, anchors_s = speculative_decode(target, make(), p, 30, BS, cuda_graphs=True)
            assert torch.equal(out, ref) and torch.equal(out_s, ref)
            assert acc_s == acc and anchors_s == anchors
    assert set(speculative_decode(target, _Spoiled(text), p, 30, BS, cuda_graphs=True)[1]) == set(range(BS))


def test_dflash2_and_sampled_decodes_are_identical_with_the_static_step(targets):
    """The same with a DFlash2 drafter's selector walk (greedy and sampled at T=1 from one seed):
    the static step feeds the selector the same features and the rejection rule the same p."""
    target = targets["qwen3"]
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=1, block_size=BS, mask_token_id=V - 1, variant="dflash2", selector_rank=8,
                        selector_top_k=6).resolve(target.hf_config, target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=2).eval()
    for seed in (4, 5):
        p = prompt(seed)
        a = speculative_decode(target, selector_proposer(drafter, head), p, 24, BS)
        b = speculative_decode(target, selector_proposer(drafter, head), p, 24, BS, cuda_graphs=True)
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
        kw = dict(temperature=1.0, top_k=20)
        a = speculative_decode(target, selector_proposer(drafter, head), p, 24, BS,
                               generator=torch.Generator().manual_seed(seed), **kw)
        b = speculative_decode(target, selector_proposer(drafter, head), p, 24, BS, cuda_graphs=True,
                               generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_eval_with_cuda_graphs_measures_the_same_and_says_so(targets):
    """dflash.eval --cuda-graphs: every figure of the decodes (and the speed's token counts) is the
    dynamic path's, and the result says the target's steps ran as CUDA graphs (JSON and table)."""
    target = targets["llama"]
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1).resolve(target.hf_config,
                                                                                  target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=3).eval()
    prompts = [prompt(8), prompt(9, 5)]
    plain = evaluate(target, drafter, head, prompts, 12, temperature=1.0, speed=True, tree_budget=5)
    graphs = evaluate(target, drafter, head, prompts, 12, temperature=1.0, speed=True, cuda_graphs=True,
                      tree_budget=5)
    assert build_parser().parse_args(["CKPT", "--data", "x", "--cuda-graphs"]).cuda_graphs
    assert build_parser().parse_args(["CKPT", "--data", "x", "--no-cuda-graphs"]).cuda_graphs is False
    assert build_parser().parse_args(["CKPT", "--data", "x"]).cuda_graphs is None  # on for CUDA, off on a CPU
    assert not plain.cuda_graphs and graphs.cuda_graphs
    assert plain.tree_tau is not None and plain.sampled_tree_tau is not None
    for name in ("tau", "sampled_tau", "acc_per_pos", "per_prompt", "streak_all", "tree_tau", "sampled_tree_tau"):
        assert getattr(graphs, name) == getattr(plain, name), name
    assert graphs.speed.new_tokens == plain.speed.new_tokens == 24
    assert "target steps as CUDA graphs" in format_result(graphs) and "CUDA graphs" in format_speed(graphs)
    assert "CUDA graphs" not in format_result(plain) + format_speed(plain)


def test_the_in_training_decode_with_cuda_graphs_measures_the_same(targets):
    """Invariant: the evaluator's decode (decode_tau, what [eval].cuda_graphs switches) gives the
    same accepted lengths, greedy and sampled, through the fixed-shape steps as through the dynamic
    cache, so its tau agrees with dflash.eval's whichever way each ran."""
    from dflash.eval.measure import decode_tau

    target = targets["qwen3"]
    head = target.shared_head()
    cfg = DrafterConfig(num_layers=2, block_size=BS, mask_token_id=V - 1).resolve(target.hf_config,
                                                                                  target.layer_ids)
    drafter = DFlashDrafter(cfg, seed=4).eval()
    prompts = [prompt(7), prompt(10, 2)]
    plain = decode_tau(target, drafter, head, prompts, 14, temperature=1.0, tree_budget=5)
    graphs = decode_tau(target, drafter, head, prompts, 14, temperature=1.0, cuda_graphs=True, tree_budget=5)
    assert (graphs.tau, graphs.sampled_tau, graphs.steps) == (plain.tau, plain.sampled_tau, plain.steps)
    assert plain.tree_tau is not None and graphs.tree_tau == plain.tree_tau


def test_an_unsupported_target_falls_back_to_the_dynamic_cache_once_logged(caplog):
    """A target the static step does not reproduce (sliding-window layers; a truncated target) is
    refused by name; a decode asked for CUDA graphs then runs the dynamic cache, logging why once."""
    sliding = load_target(TargetConfig(preset="tiny", seed=1, vocab_size=V, overrides={
        "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}), "cpu", num_draft_layers=2)
    with pytest.raises(UnsupportedTarget, match="full-attention layers only"):
        check_supported(sliding)
    truncated = load_target(TargetConfig(preset="tiny", seed=1, vocab_size=V), "cpu", 2, need_final=False)
    with pytest.raises(UnsupportedTarget, match="need_final=True"):
        check_supported(truncated)
    p = prompt(7)
    with caplog.at_level(logging.WARNING, logger="dflash.eval.decode"):
        out = greedy_decode(sliding, p, 8, cuda_graphs=True)
        greedy_decode(sliding, p, 8, cuda_graphs=True)
    assert torch.equal(out, greedy_decode(sliding, p, 8))
    told = [r.getMessage() for r in caplog.records if "no CUDA graphs" in r.getMessage()]
    assert len(told) == 1 and "full-attention layers only" in told[0]


def test_pool_reuses_a_released_step_and_never_hands_out_one_in_use(targets):
    """acquire/release: the next generation of a width gets the released instance (its graph is
    reused), a nested one gets its own cache, one that needs more room gets a larger one, and
    after the target's weights move (``.to()``, a reload) the old graph is never handed out."""
    target = targets["qwen3"]
    a = acquire(target, BS, 40)
    b = acquire(target, BS, 40)                     # a is still in use
    assert b is not a and a.capacity == 256 >= 40 + BS
    release(a)
    assert acquire(target, BS, 100) is a
    release(a)
    assert acquire(target, 1, 100) is not a         # another width
    big = acquire(target, BS, 300)
    assert big is not a and big.capacity == 512
    with pytest.raises(ValueError, match="exceed the static cache's capacity 512"):
        big(prompt(1, 3), 510)
    release(big)
    target.model.lm_head.weight.data = target.model.lm_head.weight.data.clone()   # as .to() moves it
    assert acquire(target, BS, 300) is not big      # a graph of the old addresses is never replayed


def test_a_stopped_decode_hands_its_step_back_and_a_dropped_step_is_freed_at_once(targets):
    """However a decode ends (here a stop request after two verify steps, as a time limit or a
    training run's stop asks), its static step goes back to the pool, so the next decode reuses
    its KV cache and graph rather than allocating another beside it; and a step nobody holds is
    freed by reference counting alone: no cycle through its graphed step keeps its cache alive
    until the cycle collector happens to run."""
    target = targets["llama"]
    text = greedy_decode(target, prompt(4), 30 + BS)
    asked = []
    with pytest.raises(DecodeStopped):
        speculative_decode(target, _Spoiled(text), prompt(4), 30, BS, cuda_graphs=True,
                           should_stop=lambda: asked.append(1) or len(asked) > 2)
    kept = static_target.pooled(target, BS)
    assert kept is not None and len(asked) == 3
    assert acquire(target, BS, 40) is kept
    gc.disable()
    try:
        gone = weakref.ref(kept)
        kept(prompt(5, 3), 0)                           # its step has run (the eager call, on a CPU)
        del kept
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graph capture and replay")
def test_graph_replay_equals_the_eager_static_step_on_cuda():
    """On a GPU the captured graph replays the eager static forward bit for bit (a verify sequence
    with rewinds and a short last step), and a graphed decode is token-identical to the dynamic
    path in fp32 (no capture fallback: the graph exists)."""
    target = load_target(TargetConfig(preset="tiny", seed=11, vocab_size=V, dtype="float32"), "cuda", 2)
    graphed, eager = StaticTarget(target, BS, 64, graphs=True), StaticTarget(target, BS, 64, graphs=False)
    p = prompt(1).cuda()
    for run in (graphed, eager):
        run(p, 0, last_only=True)
    start = p.shape[0]
    for i, (w, accepted) in enumerate([(BS, BS), (BS, 1), (BS, 0), (2, 2)]):
        ids = prompt(100 + i, w).cuda()
        f_g, l_g = graphed(ids, start)
        f_e, l_e = eager(ids, start)
        assert torch.equal(f_g, f_e) and torch.equal(l_g, l_e)
        start += max(accepted, 1)
    assert graphed.graph is not None and eager.graph is None
    for seed in (1, 2):
        p = prompt(seed).cuda()
        ref = greedy_decode(target, p, 40)
        text = greedy_decode(target, p, 40 + BS)
        assert torch.equal(greedy_decode(target, p, 40, cuda_graphs=True), ref)
        out, acc, _ = speculative_decode(target, _Spoiled(text), p, 40, BS, cuda_graphs=True)
        assert torch.equal(out, ref) and acc == speculative_decode(target, _Spoiled(text), p, 40, BS)[1]
    assert static_target.pooled(target, 1).graph is not None
    assert static_target.pooled(target, BS).graph is not None


def test_a_failed_capture_leaves_the_eager_step_with_one_warning(targets, monkeypatch, caplog):
    """A capture that raises (an op CUDA graphs refuse) does not fail the decode: one warning line
    saying why, then the same step eagerly, and no second attempt."""
    target = targets["qwen3"]
    run = StaticTarget(target, BS, 64)
    run.step.graphs = True                          # as on CUDA; the capture itself is made to fail
    calls = []

    def refuse():
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(run.step, "_capture", refuse)
    ref = CachedTarget(target, 64)
    p = prompt(2)
    ref(p, 0)
    run(p, 0)
    with caplog.at_level(logging.WARNING, logger="dflash.model.cuda_graph"):
        for start in (9, 10):
            ids = prompt(start, BS)
            _close(run(ids, start)[1], ref(ids, start)[1])
            ref.keep(start + 1)
    said = [r.getMessage() for r in caplog.records if r.name == "dflash.model.cuda_graph"]
    assert calls == [1] and len(said) == 1 and "\n" not in said[0]
    assert "RuntimeError: operation not permitted when stream is capturing" in said[0] and run.graph is None
