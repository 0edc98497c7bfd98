"""Every command line's --help: one line of what it does, every option explained with its default,
the exit codes, and no raw docstring markup."""

from __future__ import annotations

import argparse
import importlib

import pytest

CLIS = ["dflash.run", "dflash.eval", "dflash.export", "dflash.logs", "dflash.plot", "dflash.regenerate",
        "dflash.pretrain", "dflash.import_gguf", "dflash.plan", "csp.run", "csp.inspect", "csp.graph"]
# the module whose main() builds each command's parser (a command that is a package or a thin
# entry module runs the code of another)
MAIN_OF = {"dflash.run": "dflash.run.cli", "dflash.eval": "dflash.eval.cli", "dflash.logs": "dflash.observe.logs",
           "dflash.plot": "dflash.observe.plot",
           "dflash.plan": "dflash.plan.cli", "csp.graph": "csp.graph.draw"}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``module.main`` builds (captured at parse_args, before anything runs)."""
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured) as info:
        importlib.import_module(MAIN_OF.get(module, module)).main(["x"])
    return info.value.parser


@pytest.mark.parametrize("module", CLIS)
def test_help_says_what_it_does_explains_every_option_and_lists_exit_codes(module, monkeypatch):
    """Invariant: --help starts with a one-line summary, every option has a help text (with its
    default where one applies), the exit codes are listed, and no reST/Sphinx markup leaks."""
    parser = parser_of(module, monkeypatch)
    text = parser.format_help()
    summary = (parser.description or "").split("\n")[0]
    assert summary and summary[0].isupper() and summary.rstrip().endswith((".", "?")), summary
    assert "exit codes:" in text and "\n  0 " in text and "\n  2 " in text
    for marker in ("``", ":func:", ":mod:", ":class:", ":data:", "::"):
        assert marker not in text, marker
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 10, action.dest
        meaningful = action.default not in (None, False, [], argparse.SUPPRESS) and action.option_strings
        if meaningful:
            assert "default" in formatter._get_help_string(action).lower(), action.dest


def test_eval_help_explains_its_output_columns(monkeypatch):
    """Invariant: eval explains its output columns (streak@visited, streak@all ...) in --help, not
    only in a docstring, since --help is all a user reads."""
    text = parser_of("dflash.eval", monkeypatch).format_help()
    for column in ("accepted/step", "tokens/step", "streak@visited", "streak@all", "tau_sim"):
        assert f"\n  {column} " in text, column


@pytest.mark.parametrize("module", CLIS)
def test_help_answers_without_importing_torch(module):
    """Regression: ``dflash.eval``, ``dflash.export`` and ``dflash.logs`` imported torch (2-3 s)
    before printing --help. Invariant: every command line's --help prints without torch, and
    prints nothing on stderr (no torchao or torch import-time lines)."""
    import subprocess
    import sys

    code = (f"import runpy, sys\nsys.argv = [{module!r}, '--help']\n"
            f"try:\n    runpy.run_module({module!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: " in proc.stdout and proc.stdout.strip().endswith("TORCH False"), proc.stdout[-300:]
    assert proc.stderr == "", proc.stderr  # nothing else: no import-time lines of other packages
