"""The non-DFlash example runs from its TOML through ``python -m csp.run`` and counts correctly;
the CLI maps bad graphs to exit code 2 and process failures to 1."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import csp.run

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
TOML = REPO / "examples" / "text_pipeline.toml"


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # the graph's plugins = ["examples.textpipe"]


def expected(n: int, seed: int = 0) -> collections.Counter:
    from examples.textpipe import generate_lines, tokenize

    return collections.Counter(w for line in generate_lines(n, seed) for w in tokenize(line))


@pytest.mark.parametrize("replicas", [1, 2])
def test_example_counts_every_word(tmp_path, capsys, replicas):
    code = csp.run.main([str(TOML), "--run-dir", str(tmp_path), "-q",
                         "--set", "process.read.options.generate=600",
                         "--set", f"process.tokenize.replicas={replicas}"])
    out = capsys.readouterr().out
    assert code == 0 and "completed" in out and "tokenize[0]" in out
    result = json.loads((tmp_path / "textpipe" / "top_words.json").read_text())
    want = expected(600)
    assert result["lines"] == 600 and result["words"] == sum(want.values())
    assert dict((w, n) for w, n in result["top"]) == dict(want.most_common(10))
    assert (tmp_path / "csp" / "stats.jsonl").exists() and (tmp_path / "csp" / "trace.json").exists()


def test_example_reads_a_file(tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("The cat sat.\nthe CAT ran\n\nA dog.\n")
    code = csp.run.main([str(TOML), "--run-dir", str(tmp_path / "run"), "-q",
                         "--set", f"process.read.options.path={text}"])
    assert code == 0
    result = json.loads((tmp_path / "run" / "textpipe" / "top_words.json").read_text())
    assert result["lines"] == 4 and result["words"] == 8
    assert dict((w, n) for w, n in result["top"])["the"] == 2


def test_cli_exit_codes(tmp_path, capsys):
    assert csp.run.main([str(TOML), "--no-run-dir", "--set", "channel.lines.capactiy=1"]) == 2
    assert "unknown field `capactiy` - at `$.channel[0]`" in capsys.readouterr().err
    assert csp.run.main([str(tmp_path / "missing.toml")]) == 2
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")  # not UTF-8: fails while the run reads it
    assert csp.run.main([str(TOML), "--no-run-dir", "-q",
                         "--set", f"process.read.options.path={bad}"]) == 1
    assert "process read[0] failed: UnicodeDecodeError" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("path=NOPE", "path: no such file: 'NOPE'"),
    ("generate=-1", "Expected `int` >= 0 - at `$.process[0].options.generate`"),
])
def test_bad_read_options_are_one_line_config_errors(tmp_path, capsys, override, message):
    """Regression: a missing options.path failed the run with a traceback dump; negative
    ``generate`` was accepted. Both are config errors now: one line, exit 2, nothing started."""
    override = override.replace("NOPE", str(tmp_path / "nope.txt"))
    message = message.replace("NOPE", str(tmp_path / "nope.txt"))
    assert csp.run.main([str(TOML), "--no-run-dir", "--set", f"process.read.options.{override}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_python_m_csp_run_from_another_directory(tmp_path):
    """Regression: an absolute graph path run from elsewhere could not import its plugin
    (``examples.textpipe``); it is found next to the graph file."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "csp.run", str(TOML), "--no-run-dir", "-q",
         "--set", "process.read.options.generate=50"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("completed in")


def test_python_m_csp_run(tmp_path):
    """The documented command line, as a user types it, from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "csp.run", "examples/text_pipeline.toml", "--run-dir", str(tmp_path),
         "--set", "process.read.options.generate=300"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("completed in")
    assert json.loads((tmp_path / "textpipe" / "top_words.json").read_text())["lines"] == 300
