"""docs/failure-modes.md tells a user what every exit code means and what to do next; this keeps it
true: each command's own list of codes (what ``--help`` prints) and the page's table agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "failure-modes.md"


def _table_codes(heading: str, doc: Path = DOC) -> set[int]:
    """The codes in the first column of the table under ``### heading``."""
    text = doc.read_text(encoding="utf-8")
    section = text.split(f"### {heading}", 1)[1].split("\n### ", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", section, re.M)}


@pytest.mark.parametrize("heading, codes", [
    ("`python -m dflash.run GRAPH.toml`", "dflash.run.args"),
    ("`python -m csp.run GRAPH.toml`", "csp.run"),
])
def test_the_page_lists_exactly_the_codes_each_command_exits_with(heading, codes):
    """Invariant: a code added to (or dropped from) a command's EXIT_CODES shows on the page."""
    import importlib

    assert _table_codes(heading) == set(importlib.import_module(codes).EXIT_CODES)


def test_the_table_check_can_fail(tmp_path):
    """The check above reads the table it claims to: a page without the code 5 row differs."""
    import dflash.run.args

    page = tmp_path / "failure-modes.md"
    page.write_text(DOC.read_text(encoding="utf-8").replace("| 5 | deadlocked", "| deadlocked"))
    assert _table_codes("`python -m dflash.run GRAPH.toml`", page) != set(dflash.run.args.EXIT_CODES)
