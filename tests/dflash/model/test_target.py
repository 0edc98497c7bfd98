"""dflash.model.target: layer choice, hidden-state capture, document masking, truncation, shared head."""

from __future__ import annotations

import pytest
import torch

from dflash.model.target import (
    TargetConfig,
    default_layer_ids,
    document_causal_mask,
    load_shared_head,
    load_target,
)

TINY = TargetConfig(preset="tiny", seed=3, vocab_size=300)   # 6 layers; 2 drafter layers -> [1, 3]


@pytest.fixture(scope="module")
def target():
    return load_target(TINY, "cpu", num_draft_layers=2)


def _row(T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (1, T), generator=g)


def _public_rule(num_target_layers, num_draft_layers):
    """The public build_target_layer_ids (z-lab dflash, SGLang, vLLM speculators), verbatim."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def test_default_layer_ids_match_public_rule():
    """Invariant: the default target layers are exactly the public build_target_layer_ids wherever
    that rule gives k distinct layers short of the last one; elsewhere a config error (never a
    home-made choice that may include the last layer, as [0, 2, 3, 5] on a 6-layer target did)."""
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28, 1) == [14]
    assert default_layer_ids(6, 2) == [1, 3]
    for L in range(1, 40):
        for k in range(1, 12):
            ref = _public_rule(L, k)
            if ref == sorted(set(ref)) and ref[0] >= 0 and ref[-1] < L - 1:
                assert default_layer_ids(L, k) == ref, (L, k)
            else:
                with pytest.raises(ValueError, match=r"target.layer_ids"):
                    default_layer_ids(L, k)
    with pytest.raises(ValueError, match=r"6-layer target is too shallow.*drafter.num_layers <= 3"):
        default_layer_ids(6, 4)
    with pytest.raises(ValueError, match="num_layers"):
        default_layer_ids(4, 5)


def test_capture_equals_output_hidden_states(target):
    ids = _row()
    T = ids.shape[1]
    pos = torch.arange(T)[None]
    feats, final = target(ids, pos, torch.zeros_like(ids), need_final=True)
    hs = target.model(ids, output_hidden_states=True).hidden_states
    assert target.layer_ids == [1, 3] and feats.shape == (1, T, 2 * 128)
    # hidden_states[i + 1] is layer i's output (the last entry is post-norm: the final state)
    torch.testing.assert_close(feats, torch.cat([hs[2], hs[4]], dim=-1))
    torch.testing.assert_close(final, hs[-1])


def test_packed_documents_do_not_see_each_other(target):
    """Invariant: a packed row gives each document exactly what it gets alone (doc-aware mask,
    positions restarting per document); padding changes nothing."""
    a, b = _row(10, 1), _row(7, 2)
    ids = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    pos = torch.cat([torch.arange(10), torch.arange(7), torch.zeros(3, dtype=torch.long)])[None]
    doc = torch.tensor([[0] * 10 + [1] * 7 + [-1] * 3])
    feats, final = target(ids, pos, doc)
    fa, _ = target(a, torch.arange(10)[None], torch.zeros_like(a))
    fb, _ = target(b, torch.arange(7)[None], torch.zeros_like(b))
    torch.testing.assert_close(feats[:, :10], fa, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(feats[:, 10:17], fb, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(feats).all() and torch.isfinite(final).all()


def test_document_mask_shape_and_rows():
    doc = torch.tensor([[0, 0, 1, -1]])
    m = document_causal_mask(doc)
    assert m.shape == (1, 1, 4, 4) and m.dtype == torch.bool
    assert m[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                [False, False, True, False], [False, False, False, True]]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch-internal import on the flex path
def test_flex_target_matches_sdpa(target):
    flex = load_target(TargetConfig(**{**_fields(TINY), "attn_implementation": "flex_attention"}),
                       "cpu", num_draft_layers=2)
    ids = _row(20)
    pos = torch.cat([torch.arange(12), torch.arange(8)])[None]
    doc = torch.tensor([[0] * 12 + [1] * 8])
    f1, h1 = target(ids, pos, doc)
    f2, h2 = flex(ids, pos, doc)
    torch.testing.assert_close(f1, f2, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h1, h2, atol=1e-5, rtol=1e-4)


def _fields(cfg):
    import msgspec
    return msgspec.structs.asdict(cfg)


def test_need_final_false_keeps_only_needed_layers(target):
    short = load_target(TINY, "cpu", num_draft_layers=2, need_final=False)
    assert len(short.decoder_layers) == max(short.layer_ids) + 1 == 4
    assert short.model.get_output_embeddings() is None
    ids = _row()
    pos = torch.arange(ids.shape[1])[None]
    f_short, none = short(ids, pos, torch.zeros_like(ids), need_final=False)
    f_full, _ = target(ids, pos, torch.zeros_like(ids))
    assert none is None
    torch.testing.assert_close(f_short, f_full)   # same weights despite the truncated build
    with pytest.raises(RuntimeError, match="need_final=True"):
        short(ids, pos, torch.zeros_like(ids), need_final=True)


@pytest.mark.parametrize("tie", [False, True])
def test_shared_head_random_init_equals_target(tie):
    cfg = TargetConfig(**{**_fields(TINY), "overrides": {"tie_word_embeddings": tie}})
    tgt = load_target(cfg, "cpu", num_draft_layers=2)
    head = load_shared_head(cfg, "cpu")
    assert torch.equal(head.embed_tokens.weight, tgt.model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, tgt.model.lm_head.weight)
    assert (head.lm_head.weight is head.embed_tokens.weight) == tie
    assert not any(p.requires_grad for p in head.parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_shared_head_and_target_from_local_dir(tmp_path, tie):
    cfg = TargetConfig(**{**_fields(TINY), "overrides": {"tie_word_embeddings": tie}})
    src = load_target(cfg, "cpu", num_draft_layers=2)
    src.model.save_pretrained(tmp_path)
    local = TargetConfig(path=str(tmp_path))
    tgt = load_target(local, "cpu", num_draft_layers=2)
    head = load_shared_head(local, "cpu")
    torch.testing.assert_close(head.embed_tokens.weight, src.model.model.embed_tokens.weight)
    torch.testing.assert_close(head.lm_head.weight, src.model.lm_head.weight)
    ids = _row()
    pos = torch.arange(ids.shape[1])[None]
    torch.testing.assert_close(tgt(ids, pos, torch.zeros_like(ids))[0], src(ids, pos, torch.zeros_like(ids))[0])
    short = load_target(local, "cpu", num_draft_layers=2, need_final=False)
    assert len(short.decoder_layers) == max(short.layer_ids) + 1
    torch.testing.assert_close(short(ids, pos, torch.zeros_like(ids), need_final=False)[0],
                               src(ids, pos, torch.zeros_like(ids))[0])


ATTN_IMPLEMENTATIONS = ["sdpa", "eager", "flex_attention", "varlen"]   # every value TargetConfig accepts


def test_every_accepted_attn_implementation_is_tested():
    """Invariant: the perturbation test below covers each attn_implementation the config accepts."""
    import typing
    hint = typing.get_type_hints(TargetConfig)["attn_implementation"]
    assert set(typing.get_args(hint)) == set(ATTN_IMPLEMENTATIONS)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch-internal import on the flex path
@pytest.mark.parametrize("attn", ATTN_IMPLEMENTATIONS)
def test_target_features_never_see_the_future_or_other_documents(attn, monkeypatch):
    """Invariant (every target attn_implementation): a feature at position p depends only on
    tokens at positions <= p of its own document. Changing later tokens or another packed document
    changes nothing at positions <= the change; changing earlier tokens of the same document does
    change position p. (Regression: eager added the bool mask as +1 and masked nothing.)
    "varlen" runs on CUDA only: here its sequence boundaries and layout are checked with a
    per-sequence SDPA in place of the kernel (tests/dflash/train/test_perf_switches.py has the GPU test)."""
    if attn == "varlen":
        from dflash.model import target as target_mod
        from tests.helpers import varlen_reference

        varlen = pytest.importorskip("torch.nn.attention.varlen")
        monkeypatch.setattr(varlen, "varlen_attn", varlen_reference)
        monkeypatch.setattr(target_mod, "check_engine", lambda *a: None)
    tgt = load_target(TargetConfig(**{**_fields(TINY), "attn_implementation": attn}), "cpu",
                      num_draft_layers=2)
    ids = _row(20, seed=5)
    pos = torch.cat([torch.arange(12), torch.arange(8)])[None]
    doc = torch.tensor([[0] * 12 + [1] * 8])

    def feats(x):
        f, final = tgt(x, pos, doc)
        return torch.cat([f, final], dim=-1)

    base = feats(ids)
    p = 6                                                 # a position inside document 0
    future = ids.clone()
    future[:, p + 1:12] = (future[:, p + 1:12] + 1) % 300   # later tokens of doc 0
    torch.testing.assert_close(feats(future)[:, :p + 1], base[:, :p + 1], atol=1e-6, rtol=0)
    other = ids.clone()
    other[:, 12:] = (other[:, 12:] + 1) % 300             # all of document 1
    torch.testing.assert_close(feats(other)[:, :12], base[:, :12], atol=1e-6, rtol=0)
    first = ids.clone()
    first[:, :12] = (first[:, :12] + 1) % 300             # all of document 0
    torch.testing.assert_close(feats(first)[:, 12:], base[:, 12:], atol=1e-6, rtol=0)
    past = ids.clone()
    past[:, p - 3] = (past[:, p - 3] + 1) % 300           # earlier context of the same document
    changed = feats(past)
    assert not torch.allclose(changed[:, p], base[:, p], atol=1e-4)
    torch.testing.assert_close(changed[:, :p - 3], base[:, :p - 3], atol=1e-6, rtol=0)
    if attn != "sdpa":                                    # and the same numbers as the bool-mask path
        ref = load_target(TINY, "cpu", num_draft_layers=2)
        torch.testing.assert_close(base, torch.cat(ref(ids, pos, doc), dim=-1), atol=1e-5, rtol=1e-4)


def test_override_typos_are_config_errors(tmp_path):
    """Invariant: a target.overrides key the transformers config class does not know is a one-line
    error naming the key and its close matches (it used to be set as an inert attribute and
    silently ignored), for the preset and a local config.json alike; real fields, including those
    PretrainedConfig sets outside to_dict() (num_labels, torch_dtype alias), are accepted."""
    from transformers import Qwen3Config

    from dflash.model.target import build_hf_config

    bad = TargetConfig(preset="tiny", overrides={"initializer_rnage": 0.1})
    with pytest.raises(ValueError, match=r"^target.overrides: 'initializer_rnage' is not a "
                                         r"Qwen3Config field; did you mean 'initializer_range'") as e:
        build_hf_config(bad)
    assert "\n" not in str(e.value)
    ok = build_hf_config(TargetConfig(preset="tiny", overrides={
        "initializer_range": 0.05, "num_labels": 3, "tie_word_embeddings": True}))
    assert ok.initializer_range == 0.05 and ok.num_labels == 3 and ok.tie_word_embeddings
    Qwen3Config(num_hidden_layers=4).save_pretrained(tmp_path)           # a local config.json
    with pytest.raises(ValueError, match=r"'num_hidden_layer' is not a Qwen3Config field; did you "
                                         r"mean 'num_hidden_layers'"):
        build_hf_config(TargetConfig(path=str(tmp_path), overrides={"num_hidden_layer": 2}))
    assert build_hf_config(TargetConfig(path=str(tmp_path),
                                        overrides={"num_hidden_layers": 2})).num_hidden_layers == 2


def test_replicas_loading_at_once_get_real_weights():
    """Regression (target[0] failed with "Cannot copy out of meta tensor" when two replicas'
    threads loaded a local checkpoint at the same time): concurrent load_target calls each get
    a model with materialised weights, equal to a model loaded alone."""
    import threading
    from pathlib import Path

    from dflash.model.target import TargetConfig, load_target

    cfg = TargetConfig(path=str(Path(__file__).resolve().parents[3] / "dflash/assets/target-sharegpt-7m"))
    models, errors = [None] * 4, []

    def load(i):
        try:
            models[i] = load_target(cfg, "cpu", 2, need_final=i % 2 == 0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    ref = load_target(cfg, "cpu", 2, need_final=True).model.state_dict()
    for m in models:
        for name, p in m.model.state_dict().items():
            assert p.device.type == "cpu" and torch.equal(p, ref[name]), name
