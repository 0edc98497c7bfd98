"""Overrides and config values that used to end in a traceback (or were silently taken
literally) are each one line on stderr, exit 2, before any data work or run directory."""

from __future__ import annotations

import re

import pytest

from csp.errors import GraphError
from csp.graph.load import ECHO_LIMIT, apply_override, cut
from dflash.run.cli import main
from tests.dflash.run.test_validate import no_data_work  # noqa: F401 - the fixture
from tests.dflash.run.test_run_e2e import small

pytestmark = pytest.mark.timeout(60)

LONG = "a" * 300
CASES = [
    ("run.out_dir=/tmp/x\0y", r"^error: run.out_dir = '/tmp/x\\x00y' contains a NUL character"),
    ("target.path=/tmp/x\0y", r"^error: target.path = '/tmp/x\\x00y' contains a NUL character"),
    ('data.cache_dir="/tmp/x\0y"', r"^error: override .*the value is not valid TOML \(Illegal character"),
    ("run.seed=18446744073709551616", (r"run.seed = 18446744073709551616 is out of range: a seed is an "
                                       r"integer in -2\*\*63 \.\. 2\*\*64 - 1")),
    ("run.seed=-9223372036854775809", r"run.seed = -9223372036854775809 is out of range"),
    ("run.steps=1000000000", (r"^error: .*run.steps = 1000000000 is above 99,999,999, the most a run trains "
                              r"\(checkpoint names hold 8 digits of step\); give a smaller run.steps")),
    ("run.steps=" + "9" * 300, r"run.steps = 9+\.\.\.\(300 characters\)\.\.\.9+ is above 99,999,999"),
    ("run.steps=" + "9" * 5000, (r"^error: override 'run.steps=9+\.\.\.\(5010 characters\)\.\.\.9+': an integer "
                                 r"has more than 4,300 digits, the most Python reads; give run.steps a smaller "
                                 r"number$")),
    ("train.betas=[0.9, " + "9" * 5000 + "]", (r"^error: override .*: an integer has more than 4,300 digits.*; "
                                               r"give train.betas a smaller number$")),
    (f"run.out_dir=/tmp/{LONG}", (r"^error: run.out_dir = '/tmp/a+\.\.\.\(305 characters\)\.\.\.a+' has a "
                                  r"path component of 300 bytes \(at most 255\): give a shorter name$")),
    ("target.path=/tmp/" + "ab/" * 1500, r"^error: target.path = .* is 4505 bytes long \(at most 4095\)"),
    ("process.target.replicas=100000", (r"Expected `int` <= 4096 - at `\$\.process\[1\]\.replicas` "
                                        r"\(from --set process.target.replicas=100000\)$")),
    ('run.name="abc', (r"^error: override 'run.name=\"abc': the value is not valid TOML \(Unterminated "
                       r"string.*\); close the quote or bracket, or leave the quotes out for a plain string$")),
    ("train.betas=[0.9, 0.95", r"^error: override 'train.betas=\[0.9, 0.95': the value is not valid TOML"),
    ("k" * 100_000 + "=1", r"unknown field `k{100}\.\.\.\(100000 characters\)\.\.\.k{100}`"),
]


@pytest.mark.parametrize("override, message", CASES, ids=[re.sub(r"[^ -~]", "?", c[0][:40]) for c in CASES])
def test_bad_override_is_one_line_exit_2(tmp_path, capsys, no_data_work, override, message):  # noqa: F811
    """Invariant: a NUL byte in a path, a seed torch cannot take, run.steps past what
    checkpoint names can order, a path component or path over
    the filesystem's limits, 100,000 replicas, an unclosed quote or bracket, and a 100,000-character
    unknown key each give exit 2 and one line of at most a few hundred characters (user text cut
    to its start and end), with no traceback, before any data work or run directory."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(small(run, cache, override)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err[:2000]
    assert "Traceback" not in err and len(err) < 1000, err[:2000]
    assert re.search(message, err.rstrip("\n")), err
    assert not run.exists() and not cache.exists()


def test_an_integer_too_long_for_python_in_the_graph_file_is_one_line(tmp_path):
    """Regression: an integer of more than 4,300 digits (Python's limit on converting a decimal
    string to int) in a --set value or the graph file ended in a ValueError traceback from the
    TOML parser; it is one GraphError naming the file or the override."""
    from csp.graph.load import load_spec

    graph = tmp_path / "g.toml"
    graph.write_text("[run]\nsteps = " + "9" * 5000 + "\n")
    with pytest.raises(GraphError) as exc:
        load_spec(graph)
    assert str(exc.value) == (f"{graph}: invalid TOML: an integer has more than 4,300 digits, the most "
                              "Python reads; give a smaller number")
    data: dict = {}
    apply_override(data, "run.steps=0x" + "f" * 5000)  # power-of-two bases have no such limit
    assert data["run"]["steps"] == 16 ** 5000 - 1


def test_quotes_the_shell_removed_still_mean_a_plain_string():
    """Invariant: only a value that opens like TOML and does not parse is refused; a bare word or
    path (what a shell leaves of --set run.name="abc") is still a plain string."""
    data: dict = {}
    apply_override(data, "run.name=abc")
    apply_override(data, "run.out_dir=runs/x y")
    apply_override(data, 'target.path="/models/q"')
    assert data == {"run": {"name": "abc", "out_dir": "runs/x y"}, "target": {"path": "/models/q"}}
    with pytest.raises(GraphError, match="not valid TOML"):
        apply_override(data, "run.name='abc")
    with pytest.raises(GraphError, match="not valid TOML"):
        apply_override(data, "target.overrides={a=1")


def test_cut_keeps_start_and_end():
    text = "s" * 150 + "m" * 1000 + "e" * 150
    got = cut(text)
    assert got.startswith("s" * 100) and got.endswith("e" * 100) and "(1300 characters)" in got
    assert len(got) < ECHO_LIMIT + 40 and cut("short") == "short"
    with pytest.raises(GraphError) as exc:
        apply_override({}, "x" * 50_000)                      # no "=": the echo is cut too
    assert len(str(exc.value)) < 400 and "(50000 characters)" in str(exc.value)
