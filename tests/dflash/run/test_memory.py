"""dflash.run.memory: the estimate against the peaks measured on an H200, and the pre-run check
that stops a run that will not fit with settings that do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.h200.lengths import cell_overrides
from dflash.errors import ConfigError
from dflash.run.config import load_config
from dflash.run.memory import GIB, REFUSE_OVER, WARN_OVER, check_memory, estimate, levers
from dflash.run.resolve import load_and_resolve, target_hf_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
GRAPH = ROOT / "examples" / "qwen3-8b-h200.toml"
MEASURED = ROOT / "benchmarks" / "results" / "lengths_h200" / "lengths.json"
ONE_GPU = {"target": ["cuda:0"], "drafter": ["cuda:0"]}


def resolved(sets: list[str]):
    r, _ = load_and_resolve(load_config(GRAPH, sets))
    return r.cfg, r.drafter, target_hf_config(r.cfg.target)


def at_length(length: int, checkpointing: bool = False, extra: tuple[str, ...] = ()):
    return resolved(cell_overrides(length, 16, checkpointing, 0, 5) + list(extra))


def measured_cells():
    doc = json.loads(MEASURED.read_text())
    for row in doc["rows"]:
        target_resident = row["target"]["resident_gb"]["cuda:0"]
        yield row["length"], "target", False, row["target"]["peak_mem_gb"]["cuda:0"]
        for d in row["drafter"]:
            # the drafter was measured beside the loaded target: its peak less the target's weights
            yield row["length"], "drafter", d["checkpointing"], d["peak_mem_gb"]["cuda:0"] - target_resident


@pytest.mark.parametrize("length,stage,checkpointing,gib", list(measured_cells()),
                         ids=lambda v: str(v))
def test_estimate_matches_the_h200_table(length, stage, checkpointing, gib):
    """Within 3% where the model is linear (the target, the drafter without checkpointing, and
    checkpointing at 32K where its constant is fitted); with checkpointing at shorter rows it may
    only overestimate (by at most 30%), never fall more than 5% under."""
    (m,) = estimate(*at_length(length, checkpointing), ONE_GPU)
    got = (m.target_weights + m.target_act if stage == "target" else m.drafter_fixed + m.drafter_act) / GIB
    if stage == "target" or not checkpointing or length == 32768:
        assert got == pytest.approx(gib, rel=0.03)
    else:
        assert 0.95 * gib <= got <= 1.3 * gib


WHOLE_RUNS = ROOT / "benchmarks" / "results" / "memory_h100"


@pytest.mark.parametrize("log,sets", [
    ("mem8b.log", []),  # the file as shipped: Qwen3-8B, 4 rows of 4,096 tokens
    ("mem17-2k.log", ['target.preset="qwen3-1.7b"']),  # half the width, the same vocabulary
])
def test_estimate_matches_whole_runs_at_two_widths(log, sets):
    """A whole pipeline run's peak (target and drafter on one H100, as its summary printed it)
    against the estimate: within 5% at both widths. The width-independent part (the chunked LM
    head's buffers) is what a single-width table could not separate from the parameters' bytes."""
    text = (WHOLE_RUNS / log).read_text()
    peak, printed = map(float, re.search(r"GPU memory\s+cuda:0 peak ([\d.]+) GiB allocated, estimated ([\d.]+)",
                                         text).groups())
    (m,) = estimate(*resolved(sets), ONE_GPU)
    assert m.total / GIB == pytest.approx(peak, rel=0.05)
    assert abs(m.total / GIB - peak) <= abs(printed - peak)  # no worse than the estimate the run printed


def test_stages_on_separate_devices_are_counted_apart():
    cfg, drafter, hf = at_length(8192)
    one = estimate(cfg, drafter, hf, ONE_GPU)
    two = estimate(cfg, drafter, hf, {"target": ["cuda:0"], "drafter": ["cuda:1"]})
    assert [m.device for m in two] == ["cuda:0", "cuda:1"]
    assert two[0].drafter_fixed == two[1].target_weights == 0
    assert two[0].total + two[1].total == pytest.approx(one[0].total)
    assert estimate(cfg, drafter, hf, {"target": ["cpu"], "drafter": ["cpu"]}) == []
    # "cuda" without an index is device 0, the same card as "cuda:0"
    assert len(estimate(cfg, drafter, hf, {"target": ["cuda"], "drafter": ["cuda:0"]})) == 1


def card(gib: float):
    return lambda device: gib * GIB


def test_a_length_that_will_not_fit_stops_with_settings_that_do():
    cfg, drafter, hf = at_length(65536)
    (m,) = estimate(cfg, drafter, hf, ONE_GPU)
    assert m.total > REFUSE_OVER * 80 * GIB
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, drafter, hf, ONE_GPU, card_bytes=card(80))
    line = str(err.value)
    assert "\n" not in line and "cuda:0 needs about" in line and "data.max_length = 65,536" in line
    anchors = int(re.search(r"lower train.num_anchors to ([\d,]+)", line).group(1).replace(",", ""))
    assert "separate GPUs" in line and "run.memory_check = false" in line
    # the anchors it names fit the card: a run with them starts (near the edge, so with a warning),
    # and one more anchor per row would not fit
    fixed = resolved(cell_overrides(65536, 16, False, 0, 5) + [f"train.num_anchors={anchors}"])
    assert len(check_memory(*fixed, ONE_GPU, card_bytes=card(80))) == 1
    (over,) = estimate(*resolved(cell_overrides(65536, 16, False, 0, 5) + [f"train.num_anchors={anchors + 1}"]),
                       ONE_GPU)
    assert over.total > 80 * GIB


def test_checkpointing_is_named_when_it_alone_fits():
    cfg, drafter, hf = at_length(32768)
    (m,) = estimate(cfg, drafter, hf, ONE_GPU)
    gib = m.total / GIB / 1.16  # over the refusal line; checkpointing's estimate (-12.5 GiB) fits
    with pytest.raises(ConfigError, match=r"set \[drafter\].activation_checkpointing = true \(about \d+ GiB\)"):
        check_memory(cfg, drafter, hf, ONE_GPU, card_bytes=card(gib))
    warned = check_memory(*at_length(32768, checkpointing=True), ONE_GPU, card_bytes=card(gib))
    assert len(warned) == 1 and "set [drafter].activation_checkpointing" not in warned[0]


def test_near_the_edge_it_warns_and_goes_on():
    cfg, drafter, hf = at_length(32768)
    (m,) = estimate(cfg, drafter, hf, ONE_GPU)
    warnings = check_memory(cfg, drafter, hf, ONE_GPU, card_bytes=card(m.total / GIB))  # estimate == card
    assert len(warnings) == 1 and warnings[0].startswith("the run may run out of GPU memory: cuda:0 needs about")
    assert "If it does: " in warnings[0]
    assert check_memory(cfg, drafter, hf, ONE_GPU, card_bytes=card(m.total / GIB / WARN_OVER * 1.01)) == []


def test_packed_rows_lever_fits():
    cfg, drafter, hf = resolved(["data.max_length=4096", "data.tokens_per_batch=131072", "data.packed_rows=32",
                                 "train.num_anchors=256"])
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, drafter, hf, ONE_GPU, card_bytes=card(80))
    rows, tokens = re.search(r"lower data.packed_rows to (\d+) with data.tokens_per_batch = ([\d,]+)",
                             str(err.value)).groups()
    fixed = resolved(["data.max_length=4096", f"data.tokens_per_batch={tokens.replace(',', '')}",
                      f"data.packed_rows={rows}", "train.num_anchors=256"])
    (m,) = estimate(*fixed, ONE_GPU)
    assert m.total <= 80 * GIB
    check_memory(*fixed, ONE_GPU, card_bytes=card(80))  # starts: no ConfigError


def test_memory_check_false_skips_it():
    cfg, drafter, hf = at_length(65536, extra=("run.memory_check=false",))
    assert check_memory(cfg, drafter, hf, ONE_GPU, card_bytes=card(80)) == []


def test_no_cuda_here_skips_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_memory(*at_length(65536), ONE_GPU) == []


def test_a_device_this_machine_lacks_is_left_to_the_device_checks():
    def missing(device: str) -> float:
        raise RuntimeError(f"Invalid device {device}")

    assert check_memory(*at_length(65536), ONE_GPU, card_bytes=missing) == []


def test_the_end_record_fields_hold_the_estimate_and_the_peak(monkeypatch):
    import torch

    from dflash.run.memory import estimate_line, memory_fields

    estimates = estimate(*at_length(8192), {"target": ["cuda:0"], "drafter": ["cuda:1"]})
    assert memory_fields([]) == {}
    assert estimate_line(estimates) == "cuda:0 about 14.5 GiB (target); cuda:1 about 28.5 GiB (drafter)"
    assert estimate_line(estimate(*at_length(8192), ONE_GPU)) == "cuda:0 about 43.0 GiB (target 14.5, drafter 28.5)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_fields(estimates) == {"estimated_gib": {"cuda:0": 14.47, "cuda:1": 28.48}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: {"cuda:0": 3 * GIB, "cuda:1": GIB}[d])
    assert memory_fields(estimates)["peak_gib"] == {"cuda:0": 3.0, "cuda:1": 1.0}


SMOLLM2_CONFIG = {  # SmolLM2-135M-Instruct's config.json as python -m dflash.import_gguf writes it
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 49152, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}


def test_estimate_matches_the_smollm2_dflash2_run(tmp_path):
    """SmolLM2-135M's DFlash2 recipe with 3 layers at 512 anchors a row and the dense sdpa mask, as
    it ran on one H100 (benchmarks/results/smollm2_h100_run5/train.log: peak 25.2 GiB, then
    estimated 14.0): the selector, the convolutions and the dense mask make the rest; within 5%.
    The graph as shipped (5 layers, flex attention's block mask, 128 anchors) peaked at 9.3 GiB
    (smollm2_h100_run8/train-call2.log) against 10.0 estimated: within 10%, on the safe side."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))

    def peak(run: str, log: str) -> float:
        text = (ROOT / "benchmarks" / "results" / run / log).read_text()
        return float(re.search(r"GPU memory\s+cuda:0 peak ([\d.]+) GiB allocated", text).group(1))

    sets = [f'target.path="{tmp_path}"', 'target.tokenizer="builtin:tiny"', "target.vocab_size=49152",
            'drafter.attn_implementation="sdpa"', "train.num_anchors=512", "drafter.num_layers=3"]
    r, _ = load_and_resolve(load_config(ROOT / "examples" / "smollm2-h200.toml", sets))
    (m,) = estimate(r.cfg, r.drafter, target_hf_config(r.cfg.target), ONE_GPU)
    assert m.total / GIB == pytest.approx(peak("smollm2_h100_run5", "train.log"), rel=0.05)
    r, _ = load_and_resolve(load_config(ROOT / "examples" / "smollm2-h200.toml", sets[:3]))
    assert r.drafter.num_layers == 5
    (shipped,) = estimate(r.cfg, r.drafter, target_hf_config(r.cfg.target), ONE_GPU)
    measured = peak("smollm2_h100_run8", "train-call2.log")
    assert measured <= shipped.total / GIB <= 1.1 * measured


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_checkpointing_lever_equals_the_checkpointed_estimate_for_dflash2(tmp_path, attn):
    """The lever's figure is the estimate of the run with checkpointing on: checkpointing shrinks
    DFlash2's layers, not its selector or the dense mask."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    sets = [f'target.path="{tmp_path}"', 'target.tokenizer="builtin:tiny"', "target.vocab_size=49152",
            f'drafter.attn_implementation="{attn}"', "train.num_anchors=512"]

    def total(extra):
        r, _ = load_and_resolve(load_config(ROOT / "examples" / "smollm2-h200.toml", sets + extra))
        (m,) = estimate(r.cfg, r.drafter, target_hf_config(r.cfg.target), ONE_GPU)
        return r, m

    r, m = total([])
    _, ck = total(["drafter.activation_checkpointing=true"])
    (lever,) = [t for t in levers(r.cfg, r.drafter, m, m.total) if "activation_checkpointing" in t]
    said = float(re.search(r"about ([\d.]+) GiB", lever).group(1))
    assert said == pytest.approx(ck.total / GIB, abs=0.5)
