"""docs/configuration.md is generated from the config structs (``python -m dflash.run.config_doc``);
this fails when the page and the code disagree, or when a key has no meaning written for it."""

from __future__ import annotations

from pathlib import Path

import msgspec

from dflash.run.config_doc import TABLES, render

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_page_is_what_the_structs_generate():
    """Invariant: the committed page is the generator's output; after changing a table, run
    ``python -m dflash.run.config_doc -o docs/configuration.md``."""
    assert PAGE.read_text(encoding="utf-8") == render()


def test_every_key_of_every_table_is_on_the_page_with_a_meaning():
    """Invariant: each key a graph file may hold is documented: its row exists and says what it
    means (a field with no docstring and no Attributes entry would leave the cell empty)."""
    text = render()
    for header, struct, _ in TABLES:
        section = text.split(f"## `{header}`", 1)[1].split("\n## ", 1)[0]
        for f in msgspec.structs.fields(struct):
            if f.name in ("channel", "process") or isinstance(f.default, msgspec.Struct):
                continue
            row = next((line for line in section.splitlines() if line.startswith(f"| `{f.name}` |")), None)
            assert row is not None, (header, f.name)
            assert not row.rstrip().endswith("|  |"), (header, f.name)
