"""dflash.run.validate through ``python -m dflash.run``: cross-table config errors are one line, exit 2,
and come before any data work (no tokenization, no cache, no run directory)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dflash.errors import ConfigError
from dflash.observe.config import check_monitor
from dflash.run.cli import main
from dflash.run.config import load_config
from dflash.run.resolve import load_and_resolve
from dflash.run.validate import validate
from tests.dflash.run.test_run_e2e import GRAPH, small

pytestmark = pytest.mark.timeout(60)


def preflight(cfg) -> list[str]:
    """What ``python -m dflash.run`` checks before any data work: resolve, then validate."""
    resolved, _ = load_and_resolve(cfg)
    return validate(resolved, launched=False, resume="none")


@pytest.fixture
def no_data_work(monkeypatch):
    """Fail the test if dflash.run gets as far as reading the data."""
    import dflash.data

    def boom(*args, **kwargs):
        raise AssertionError("load_dataset was called: the config error came after data work")

    monkeypatch.setattr(dflash.data, "load_dataset", boom)


CASES = [
    ("drafter.num_layers=9", r"drafter.num_layers = 9: a 8-layer target is too shallow"),
    ("target.layer_ids=[99]", r"target.layer_ids = \[99\] must be distinct ids in \[0, 7\]"),
    # the last layer's feature is post-norm in z-lab's and SpecForge's decoders: an export would draft wrong
    ("target.layer_ids=[1,7]", r"target.layer_ids = \[1, 7\] include 7, the last layer of the 8-layer "
     r"target: .*after the final norm.*use ids in \[0, 6\]"),
    ("drafter.hidden_size=64", r"drafter.hidden_size = 64 must equal the target's hidden size 256"),
    ("drafter.attn_implementation=\"flex_attention\"",
     r"drafter.attn_implementation = \"flex_attention\" needs a CUDA drafter, but process 'drafter' "
     r"runs on cpu"),
    ("train.lr=1e39", r"train.lr = 1e\+39 is not a usable learning rate"),
    ("train.lr=inf", r"train.lr = inf is not a usable learning rate"),
    ("target.overrides={initializer_rnage=0.1}",
     r"target.overrides: 'initializer_rnage' is not a Qwen3Config field; did you mean "
     r"'initializer_range'"),
    # a missing directory said "has no config.json"; it must say the path does not exist
    ("target.path=\"/nonexistent/dflash-target\"",
     r"target.path = '/nonexistent/dflash-target' does not exist \(or is not a directory\); point it at"),
    (f"target.path=\"{Path(__file__).parent}\"",
     rf"target.path = '{Path(__file__).parent}' has no config.json; point it at"),
]


@pytest.mark.parametrize("override, message", CASES, ids=[c[0] for c in CASES])
def test_cross_table_errors_are_one_line_exit_2_before_any_data_work(
        tmp_path, capsys, no_data_work, override, message):
    """Invariant: a config whose tables disagree (drafter vs target depth/width, layer ids out of
    range or naming the target's last layer, flex attention on a CPU drafter, an lr AdamW cannot represent, a typo in
    target.overrides, a target.path that is missing or holds no config.json) exits 2 with one
    plain line on stderr naming the key, before any
    tokenization: no data cache and no run directory are written."""
    import re

    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(small(run, cache, override)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert "Traceback" not in err
    assert not run.exists() and not cache.exists()


def test_missing_wandb_is_a_config_error_naming_the_key(tmp_path, capsys, no_data_work, monkeypatch):
    """Invariant: [monitor].wandb = "offline" (the default) with wandb not importable is a one-line
    exit-2 error naming monitor.wandb and both ways out, before any data work (it used to tokenize
    the data and then fail in the monitor at step 0)."""
    monkeypatch.setitem(sys.modules, "wandb", None)       # as if not installed: find_spec -> None
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(small(run, cache, "monitor.wandb=\"offline\"")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: monitor.wandb = 'offline' needs the wandb")
    assert "monitor.wandb = \"disabled\"" in err and "pip install wandb" in err
    assert not run.exists() and not cache.exists()
    cfg = load_config(GRAPH, ["monitor.wandb=disabled"])
    check_monitor(cfg.monitor)                              # "disabled" never needs wandb


def test_default_graph_passes_preflight():
    """Invariant: the shipped debug graph and its shrunk test variant have no cross-table problem
    (preflight must not reject a config that trains)."""
    args = small(Path("/nonexistent/run"), Path("/nonexistent/cache"))
    sets = [a for a in args[1:] if a != "--set"]
    assert preflight(load_config(GRAPH)) == []
    assert preflight(load_config(GRAPH, sets)) == []


def test_large_but_representable_lr_warns(capsys):
    """Invariant: an lr above 1 (legal, float32-safe, but no AdamW run survives it) is a warning,
    not an error; the run may still be used to study a blow-up."""
    warnings = preflight(load_config(GRAPH, ["train.lr=1e30"]))
    assert len(warnings) == 1 and "train.lr = 1e+30 is above 1" in warnings[0]
    with pytest.raises(ConfigError, match=r"train.betas = \[1.0, 0.95\] must both be in \[0, 1\)"):
        load_config(GRAPH, ["train.betas=[1.0, 0.95]"])
