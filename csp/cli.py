"""Command-line conventions shared by every ``python -m csp.*`` and ``python -m dflash.*`` tool.

Each tool's ``--help`` says in one line what it does, gives every option a help text with its
unit and default, and ends with the exit codes (and examples). :func:`make_parser` builds such a
parser; :class:`HelpFormatter` appends ``(default: X)`` to an option's help when it has a
meaningful default (not None, False or an empty list) and the help does not already name it.

Importing this module imports only :mod:`argparse`, so ``--help`` stays fast (no torch).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Iterable, Mapping

from csp._guard import check as _check_owner

_check_owner("csp", Path(__file__).parent)  # every csp CLI imports this module


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description and epilog as written (line breaks are meaningful) and adds
    ``(default: X)`` to option help texts where a default exists."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or default is argparse.SUPPRESS
                or default is None or default is False or default == [] or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def make_parser(prog: str, summary: str, *, exit_codes: Mapping[int, str],
                details: str = "", examples: Iterable[str] = ()) -> argparse.ArgumentParser:
    """An ArgumentParser whose help reads: usage, ``summary`` (one line), ``details``, options,
    then "exit codes:" (one line per code) and "examples:".

    Args:
        prog: e.g. ``"python -m csp.run"``.
        summary: one sentence saying what the command does.
        exit_codes: ``{code: meaning}``.
        details: optional plain-text paragraphs after the summary (no markup).
        examples: command lines shown at the end.
    """
    width = max(len(str(c)) for c in exit_codes) if exit_codes else 1
    epilog = "exit codes:\n" + "\n".join(f"  {str(c).ljust(width)}  {m}" for c, m in exit_codes.items())
    examples = list(examples)
    if examples:
        epilog += "\n\nexamples:\n" + "\n".join(f"  {e}" for e in examples)
    description = summary + (f"\n\n{details.strip()}" if details.strip() else "")
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                   formatter_class=HelpFormatter)


def positive_float(text: str) -> float:
    """argparse ``type=`` for a finite number that must be > 0 (e.g. a window in seconds);
    ``inf``, ``nan`` and numbers too large for a float (``1e999``, which reads as ``inf``) are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=`` for a whole number that must be >= 1 (e.g. a count of records)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


__all__ = ["HelpFormatter", "make_parser", "positive_float", "positive_int"]
