"""dflash.plan: the layout model's ranking on stated inputs, and its check against a measured run of
the tiny graph on the CPU (predicted from the stages' busy time vs the monitor's measured tok/s)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash.plan import Inputs, colocated, from_run, layouts
from dflash.plan.cli import main
from dflash.plan.model import evaluate_split, pod_rate
from dflash.plan.write import command, graph_dict, placement

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[3]

# The committed one-H200 figures (benchmarks/results/LOG.md): Qwen3-8B target alone 33.6K tok/s, drafter
# alone 44.5K; 5 captured layers x H 4096 x 2 bytes + 21 bytes of ids and masks; 1.05B fp32 drafter.
H200 = Inputs(target_tok_s=33.6e3, drafter_tok_s=44.5e3, coloc=0.99, coloc_source="test",
              bytes_per_token=5 * 4096 * 2 + 21, grad_bytes=4.2e9, tokens_per_batch=16384,
              target_mem=16e9, drafter_mem=60e9)


def test_two_gpus_colocated_beats_one_to_one_and_the_ratio_is_the_papers():
    """Invariant: on 2 GPUs colocated data-parallel (2 x 0.99 / (1/T + 1/D)) ranks above the 1:1
    split bounded by the target (T), and the ratio printed is split / colocated. The hybrid (both
    GPUs run a target, one also the drafter: T (1 + f) / (1 + T/D)) edges out colocated."""
    ranked = layouts(H200, 2)
    base = colocated(H200, 2)
    assert [x.name for x in ranked[:2]] == ["pods 2t+1d shared on 2 GPUs x1", "colocated x2"]
    assert base.tok_s == pytest.approx(2 * 0.99 / (1 / 33.6e3 + 1 / 44.5e3))
    split = next(x for x in ranked if x.name == "split 1:1")
    assert split.tok_s == pytest.approx(33.6e3) and split.bound == "target"
    assert split.tok_s / base.tok_s == pytest.approx(0.885, abs=0.005)


def test_a_costly_colocation_moves_the_best_layout_to_six_targets_to_one():
    """Invariant: colocated data-parallel is the continuous optimum times the colocation
    efficiency, so when sharing a GPU costs 20% and the drafter is 6.5x faster than the target, the
    best 7-GPU layout gives the drafter a GPU of its own and 6 targets (bounded by them)."""
    costly = Inputs(**{**_fields(H200), "drafter_tok_s": 6.5 * 33.6e3, "coloc": 0.8})
    best = layouts(costly, 7)[0]
    assert (best.targets, best.drafters, best.bound, best.shared) == (6, 1, "target", False)
    assert best.tok_s == pytest.approx(6 * 33.6e3)
    assert best.tok_s > 1.2 * colocated(costly, 7).tok_s
    cheap = Inputs(**{**_fields(costly), "coloc": 0.99})
    assert layouts(cheap, 7)[0].shared  # sharing is nearly free: a layout with a shared GPU wins


def test_hybrid_pod_rate():
    """Invariant: a pod whose drafter shares a GPU with a target splits that GPU's time:
    x = T (g - 1 + f) / (1 + T / D); with g = 1 that is colocated, f / (1/T + 1/D)."""
    t, d, f = 33.6e3, 44.5e3, 0.99
    assert pod_rate(H200, 1, 1)[0] == pytest.approx(f / (1 / t + 1 / d))
    assert pod_rate(H200, 2, 2) == (pytest.approx(t * (1 + f) / (1 + t / d)), "shared GPU")
    assert pod_rate(H200, 2, 1) == (pytest.approx(t), "target")


def test_the_network_bounds_a_split_over_hosts_but_not_pods():
    """Invariant: across hosts a split deals (H-1)/H of the hidden states over the network, which a
    slow NIC makes the bound; pods keep them in the host, so they rank first."""
    slow = Inputs(**{**_fields(H200), "net_bytes_per_s": 0.5e9, "grad_bytes": 1e6})  # 4 Gbit/s per GPU
    split = evaluate_split(slow, 16, 2, 8)
    assert split.bound == "hidden over the network"
    assert split.tok_s == pytest.approx(8 * 0.5e9 / (H200.bytes_per_token * 0.5))
    assert split.cross_host_gb_s == pytest.approx(8 * 0.5)  # the 8 target GPUs' NICs, full
    best = layouts(slow, 16, 2)[0]
    assert best.kind == "pods" and best.cross_host_gb_s == 0


def test_the_all_reduce_bounds_many_drafters_on_a_slow_network():
    """Invariant: the ring all-reduce of the drafter's gradients bounds n drafters at
    n x tokens / (2 (n-1)/n x bytes / link)."""
    slow = Inputs(**{**_fields(H200), "net_bytes_per_s": 5e9})
    lay = colocated(slow, 16, 2)
    step_s = 2 * 15 / 16 * 4.2e9 / 5e9
    assert lay.bound == "all-reduce over the network" and lay.tok_s == pytest.approx(16 * 16384 / step_s)


def test_memory_drops_layouts_that_do_not_fit():
    """Invariant: --gpu-mem leaves out layouts whose fullest GPU needs more (a shared GPU holds the
    target and the drafter: 76 GB here)."""
    names = {x.name for x in layouts(H200, 2, gpu_mem_gib=70)}
    assert "colocated x2" not in names and "split 1:1" in names
    with pytest.raises(ValueError, match="multiple of hosts"):
        layouts(H200, 9, 2)


def test_placement_is_host_local_devices_and_global_ranks():
    """Invariant: a layout's devices are host-local (cuda:0 on each host) and its ranks global,
    numbered host by host as torchrun does; a drafter replica is one rank."""
    lay = evaluate_split(H200, 16, 2, 10)
    p = placement(lay)
    assert p["drafter"] == (["cuda:5", "cuda:6", "cuda:7"] * 2, [0, 1, 2, 3, 4, 5])
    assert p["target"][0] == [f"cuda:{i}" for i in range(5)] * 2
    assert p["target"][1] == [0, 1, 2, 0, 1, 3, 4, 5, 3, 4]
    assert "--nnodes 2 --nproc-per-node 3" in command(lay, "g.toml")


def _fields(inp: Inputs) -> dict:
    return {f: getattr(inp, f) for f in inp.__struct_fields__}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny graph, random-init target, 2 target replicas, 24 steps on the CPU."""
    from dflash.run.cli import main as run_main

    out = tmp_path_factory.mktemp("plan") / "run"
    sets = [f"run.out_dir={out}", "run.steps=24", "checkpoint.every=24", "monitor.wandb=disabled", "eval.every=0",
            "monitor.display=plain", "monitor.plot=false", "data.max_samples=150", "data.max_length=256",
            "data.tokens_per_batch=1024", "data.packed_rows=4", "trace.perfetto=false",
            f"data.cache_dir={out.parent / 'cache'}", "monitor.window=8"]
    assert run_main([str(ROOT / "examples" / "dflash-tiny.toml"), *[x for s in sets for x in ("--set", s)]]) == 0
    return out


def test_predicted_matches_the_measured_tiny_run(tiny_run):
    """Invariant: the stages' capacities (busy time per batch, times real tokens per batch) explain
    the run: the lowest one is within 50% of the tok/s the monitor measured (its own clock and token
    count), and the drafter's size comes from the checkpoint. The bound is loose on purpose: here
    two target replicas and the drafter share two CPU cores, often with other jobs, so a stage's busy
    time includes time it was descheduled (predicted 647 against 1,085 tok/s was seen on a loaded
    machine). A wrong unit (per batch vs per token, padding counted) is off by far more; the 10%
    check is against the committed H200 runs, below."""
    import json

    m = from_run(tiny_run)
    monitor = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    tok_s = [r["tok_s"] for r in monitor if r["kind"] == "train"][1:]  # the first window holds start-up
    measured = sum(tok_s) / len(tok_s)
    assert abs(m.predicted_tok_s / measured - 1) <= 0.5, (m.predicted_tok_s, measured)
    assert abs(m.measured_tok_s / measured - 1) <= 0.35  # over the whole stats window, start-up included
    assert m.inputs.grad_bytes > 1e6 and m.inputs.bytes_per_token > 256 * 2  # k x H x bf16 at least


def test_the_plans_drafter_memory_is_the_run_checks_estimate(tiny_run):
    """Invariant: the plan reads a finished run's drafter memory by the model the run's own memory
    check uses (:func:`dflash.run.memory.drafter_bytes`, fixed part and activations), the dense
    sdpa mask included: the tiny graph's drafter attends through one, and the two figures agree to
    the weight bytes' rounding (the plan counts the checkpoint's file, the check the config)."""
    import json

    from dflash.checkpoint.resume import saved_drafter_config
    from dflash.run.config import load_config
    from dflash.run.memory import (
        dense_mask_elements,
        drafter_bytes,
        drafter_slots,
        head_rows,
    )

    cfg = load_config(tiny_run / "config.toml")
    ckpt = max((tiny_run / "checkpoints").glob("step_*"))
    drafter = saved_drafter_config(json.loads((ckpt / "drafter_config.json").read_text()))
    assert drafter.attn_implementation == "sdpa" and dense_mask_elements(cfg, drafter) > 0
    slots = drafter_slots(cfg, drafter.block_size)
    fixed, act = drafter_bytes(drafter, slots, checkpointing=drafter.activation_checkpointing,
                               head_rows=head_rows(slots, lm_head_chunk=cfg.train.lm_head_chunk,
                                                   sync_free_loss=cfg.train.sync_free_loss),
                               mask_elements=dense_mask_elements(cfg, drafter))
    assert from_run(tiny_run).inputs.drafter_mem == pytest.approx(fixed + act, rel=0.01)


def test_cli_writes_a_graph_that_loads_and_places(tiny_run, tmp_path, capsys):
    """Invariant: the written graph is a valid dflash.run graph whose placement matches the
    world size of the printed torchrun command; a bad run dir or bad numbers exit 2."""
    import csp
    import dflash.run.stages  # noqa: F401  (registers the dflash.* kinds)
    from csp.distributed.placement import place
    from dflash.run.config import load_config

    out = tmp_path / "plan.toml"
    assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vs colocated" in text and "check: this run's layout predicted" in text
    assert "over the whole stats log, start-up included" in text  # not the summary's mean of windows
    world = int(re.search(r"--nproc-per-node (\d+)", text).group(1)) if "torchrun" in text else 1
    cpu = tmp_path / "cpu.toml"
    cpu.write_text(re.sub(r"cuda:\d+", "cpu", out.read_text()))
    graph = csp.Graph.from_spec(load_config(cpu))
    assert len(place(graph, world).ranks_of("drafter")) == world
    assert main([str(tmp_path / "missing"), "--gpus", "8"]) == 2
    assert main([str(tiny_run), "--extrapolate", "--gpus", "9", "--hosts", "2"]) == 2
    with pytest.raises(SystemExit) as e:
        main([str(tiny_run), "--extrapolate", "--gpus", "0"])
    assert e.value.code == 2


def test_rates_measured_on_a_cpu_are_laid_out_on_gpus_only_when_told(tiny_run, tmp_path, capsys):
    """Regression: dflash.plan laid out GPUs from stage rates measured on a CPU without a word.
    Invariant: refused (one line, exit 2) unless --extrapolate, which marks every predicted figure
    ~ and says so above the table and in the written graph's header; rates given for both stages
    are taken as the GPU rates they claim to be."""
    assert main([str(tiny_run), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured on a CPU" in err and "--extrapolate" in err
    out = tmp_path / "plan.toml"
    assert main([str(tiny_run), "--gpus", "8", "--extrapolate", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("EXTRAPOLATED: ")
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    table = lines[head + 1:lines.index("", head)]
    assert table and all(" ~" in row for row in table), table
    assert "EXTRAPOLATED from CPU rates" in out.read_text().splitlines()[0]
    assert main([str(tiny_run), "--gpus", "8", "--target-tok-s", "30000", "--drafter-tok-s", "40000"]) == 0
    assert "EXTRAPOLATED" not in capsys.readouterr().out


def test_o_replaces_only_its_own_plans_and_never_the_runs_config(tiny_run, tmp_path, capsys):
    """Regression: ``-o FILE`` silently overwrote any file, the run's own config.toml included.
    Invariant: a plan it wrote is replaced; another file is refused (one line, exit 2, untouched)
    unless --force; the run's config.toml is refused even with --force."""
    plan = tmp_path / "plan.toml"
    assert main([str(tiny_run), "--extrapolate", "--gpus", "4", "-o", str(plan)]) == 0
    assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(plan)]) == 0  # its own plan: replaced
    assert "--gpus 8" in plan.read_text().splitlines()[0]
    notes = tmp_path / "notes.toml"
    notes.write_text("[mine]\nkeep = true\n")
    capsys.readouterr()
    assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a plan dflash.plan wrote" in err and "--force" in err
    assert notes.read_text() == "[mine]\nkeep = true\n"
    assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(notes), "--force"]) == 0
    assert notes.read_text().startswith("# dflash.plan ")
    config = tiny_run / "config.toml"
    before = config.read_bytes()
    for extra in ([], ["--force"]):
        assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(config), *extra]) == 2
        assert "the run's own config.toml" in capsys.readouterr().err
    assert config.read_bytes() == before


def test_o_refuses_a_link_to_the_runs_config_and_an_empty_path(tiny_run, tmp_path, capsys):
    """Invariant: ``-o`` naming a hard link or a symlink to the run's config.toml is the run's
    config.toml (refused even with --force, the file untouched), and ``-o ""`` is an error, not a
    plan written nowhere; a plan written over a file replaces it by a rename, so another hard link
    to the old file keeps its contents. Regression: the hard link was overwritten with --force
    (the check compared resolved paths, which a hard link does not share), and ``-o ""`` exited 0
    writing nothing without a word."""
    import os

    config = tiny_run / "config.toml"
    before = config.read_bytes()
    hard, soft = tmp_path / "hard.toml", tmp_path / "soft.toml"
    os.link(config, hard)
    soft.symlink_to(config)
    for link in (hard, soft):
        assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(link), "--force"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the run's own config.toml" in err, err
    assert config.read_bytes() == before
    assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-o '' is not a file path" in err, err
    mine, twin = tmp_path / "mine.toml", tmp_path / "twin.toml"
    mine.write_text("[mine]\n")
    os.link(mine, twin)
    assert main([str(tiny_run), "--extrapolate", "--gpus", "8", "-o", str(mine), "--force"]) == 0
    assert mine.read_text().startswith("# dflash.plan ") and twin.read_text() == "[mine]\n"
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_graph_dict_keeps_the_run_and_moves_its_out_dir(tiny_run):
    """Invariant: the written graph is the run's config with only placement, channel flags and
    out_dir changed."""
    m = from_run(tiny_run)
    lay = colocated(m.inputs, 4)
    g = graph_dict(m.config, lay, "colocated-x4")
    assert g["run"]["out_dir"].endswith("-colocated-x4") and g["data"] == m.config["data"]
    hidden = next(c for c in g["channel"] if c["name"] == "hidden")
    assert hidden["rank_local"] and not hidden["ordered"]


@pytest.mark.parametrize("text, says", [
    (b"[data]\nseed = " + b"1" * 5000 + b"\n", "an integer has more than 4,300 digits"),
    (b"[data\n", "invalid TOML"), (b"\xff\xfe", "not a UTF-8 text file")])
def test_an_unreadable_config_toml_is_one_line_naming_the_file(tmp_path, capsys, text, says):
    """Regression (tester): a hand-edited integer of more than 4,300 digits in the run's config.toml
    (Python's int-string limit: a bare ValueError, not a TOML error) was a traceback. Invariant: any
    config.toml that is not readable TOML is one line naming the file, exit 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_bytes(text)
    assert main([str(run), "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and f"{run / 'config.toml'}: " in err and says in err, err


def test_the_model_predicts_the_committed_h200_runs_within_ten_percent():
    """Invariant: fed only the stage rates measured alone in a committed H200 run
    (benchmarks/results/h200.json, each run's target and drafter alone), the model predicts that
    same run's measured layouts within 10%: in the 2-GPU run, the 1:1 split over 2 GPUs (target on
    cuda:0, drafter on cuda:1; measured 27.0K) and one GPU running both stages (the serial loop 14.9K,
    the csp pipeline 15.1K); in the 1-GPU bf16 run (SUITE=fastest, compiled drafter), one GPU
    running both (colocated 19.8K, serial 19.8K, pipeline 20.1K). Each run's stages predict only
    that run: the two ran different code months apart. The colocation factor is the model's stated
    default."""
    import json

    doc = json.loads((ROOT / "benchmarks" / "results" / "h200.json").read_text())

    def inputs(run: dict) -> Inputs:
        ms = run["measurements"]
        return Inputs(target_tok_s=ms["target_alone"]["tok_s"], drafter_tok_s=ms["drafter_alone"]["tok_s"],
                      coloc=0.99, coloc_source="default", bytes_per_token=5 * 4096 * 2 + 21, grad_bytes=4.2e9,
                      tokens_per_batch=16384)

    two = doc["runs"]["2gpu"]["measurements"]
    split = evaluate_split(inputs(doc["runs"]["2gpu"]), 2, 1, 1)
    assert split.bound == "target"
    assert split.tok_s == pytest.approx(two["pipeline_2gpu"]["tok_s"], rel=0.10)
    for run, names in (("2gpu", ("serial", "pipeline_1gpu")), ("1gpu", ("colocated_1gpu", "serial", "pipeline_1gpu"))):
        one = colocated(inputs(doc["runs"][run]), 1)
        for name in names:
            assert one.tok_s == pytest.approx(doc["runs"][run]["measurements"][name]["tok_s"], rel=0.10), (run, name)
