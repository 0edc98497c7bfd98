"""The command line every recipe shares: one parser whose subcommands are the recipe's phases,
each option typed and shown with its default, ``--set KEY=VALUE`` passed through to ``dflash.run``,
and the exit codes listed at the end of ``--help``.

Only the standard library is imported here: a recipe parses its arguments on a bare GPU image,
before the wheels it carries (msgspec among them, which ``csp`` and ``dflash`` import) are installed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

EXIT_CODES = {
    0: "the phase ran to its end (a step that failed says so in its line, rc=N, and its log)",
    1: "a step the phase depends on left nothing to go on (no checkpoint, no metrics, no data)",
    2: "bad arguments",
}
EXIT_EPILOG = "exit codes:\n" + "\n".join(f"  {c}  {m}" for c, m in EXIT_CODES.items())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and adds ``(default: X)`` where an option has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, False, [], argparse.SUPPRESS)
                or not action.option_strings):
            return text
        if isinstance(action.default, list):  # as typed: space-separated words
            return f"{text} (default: {' '.join(map(str, action.default)).replace('%', '%%')})"
        return f"{text} (default: %(default)s)"


def recipe_parser(prog: str, doc: str, examples: list[str]) -> argparse.ArgumentParser:
    """The recipe's parser: ``doc``'s first line is the summary, the rest its details."""
    summary, _, details = doc.strip().partition("\n")
    epilog = EXIT_EPILOG + "\n\nexamples:\n" + "\n".join(f"  {e}" for e in examples)
    description = summary + ("\n\n" + details.strip() if details.strip() else "")
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)


def add_phase(subparsers, name: str, doc: str, run: Callable[[argparse.Namespace], int],
              parents: list[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """A phase (subcommand) whose ``--help`` is ``doc``, with the options of ``parents`` (those every
    phase shares); ``args.run(args)`` runs it."""
    summary = doc.strip().split("\n")[0]
    p = subparsers.add_parser(name, help=summary, description=doc.strip(), epilog=EXIT_EPILOG,
                              formatter_class=HelpFormatter, parents=list(parents))
    p.set_defaults(run=run)
    return p


def add_set(p: argparse.ArgumentParser, what: str = "every dflash.run of the phase") -> None:
    """``--set KEY=VALUE`` (repeatable), passed on to ``what``."""
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a config override (TOML value, as dflash.run's --set) added to {what}; repeatable")


def toml_value(value: object) -> str:
    """A Python value as a ``--set`` value: TOML strings are quoted, booleans lower case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def sets(*pairs: tuple[str, object], extra: list[str] = ()) -> list[str]:
    """``--set KEY=VALUE`` arguments for ``dflash.run``: ``pairs`` (formatted by :func:`toml_value`),
    then ``extra`` (already ``KEY=VALUE`` strings, as the user typed them)."""
    out: list[str] = []
    for key, value in pairs:
        out += ["--set", f"{key}={toml_value(value)}"]
    for kv in extra:
        out += ["--set", kv]
    return out


def named_row(text: str) -> tuple[str, list[str]]:
    """``"NAME --set k=v ..."`` -> ``(NAME, ["--set", "k=v", ...])``: a named run and its arguments,
    split on white space with quotes kept (``--set drafter.precision="fp8"`` stays a TOML string).

    Raises:
        argparse.ArgumentTypeError: no name, or a name that is not one word of letters, digits, _ . -
            starting with a letter or digit.
    """
    words = text.split()
    if not words or not words[0][0].isalnum() or not all(c.isalnum() or c in "_.-" for c in words[0]):
        raise argparse.ArgumentTypeError(f"{text!r}: want 'NAME --set KEY=VALUE ...' with a one-word NAME")
    return words[0], words[1:]


def nonnegative_int(text: str) -> int:
    """argparse ``type=`` for a whole number >= 0 (a step count, seconds where 0 means off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def phase_arguments(scratch: str, scratch_help: str, graph_help: str = "the graph every run trains"
                    ) -> argparse.ArgumentParser:
    """The arguments every phase of a recipe takes, as a parent parser: ``OUT`` (where the results
    go), ``--scratch`` (the working directory the phases share; default ``scratch``) and ``--graph``
    (default the H200 ShareGPT graph)."""
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("out", type=Path, help="where the results go (OUT)")
    shared.add_argument("--scratch", type=Path, default=Path(scratch), help=scratch_help)
    shared.add_argument("--graph", default="examples/sharegpt-target-h200.toml", help=graph_help)
    return shared
