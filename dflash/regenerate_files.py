"""The files ``python -m dflash.regenerate`` writes and reads back: its output JSONL (one finished
conversation per line, each with the ``source_index`` of its record), the settings recorded beside
it in ``OUT.meta.json`` (a resume must use the same), and an ``--exclude`` file's indices.

A resume trusts only what is whole: a torn last line (a kill mid-write) is cut off, and the
settings file is replaced atomically. It imports the standard library only (``--help`` of
:mod:`dflash.regenerate`, the command, stays quick).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["done_indices", "excluded_indices", "generation_settings", "read_meta_settings", "write_meta"]

_FORMAT_VERSION = 1


def generation_settings(args: argparse.Namespace, source: str) -> dict[str, Any]:
    """The settings that change the output; a resume must use the same."""
    settings = {"version": _FORMAT_VERSION, "source": source, "max_new_tokens": args.max_new_tokens,
                "max_prompt_tokens": args.max_prompt_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "seed": args.seed, "max_turns": args.max_turns}
    if getattr(args, "repetition_keep", None) is not None:   # only when set: older files resume as they did
        settings["repetition_keep"] = args.repetition_keep
    return settings


def read_meta_settings(meta: Path, out: Path) -> dict[str, Any] | None:
    """The ``settings`` recorded in ``meta`` (``OUT.meta.json``), or None when there is none.

    Raises:
        DataError: ``meta`` is unreadable, not JSON (torn) or has no ``settings`` object; the
            message names the file and what to do.
    """
    from dflash.data import DataError

    try:
        text = meta.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataError(f"{meta}: cannot read the settings file of {out}: {e}") from None
    try:
        settings = json.loads(text)["settings"]
        if not isinstance(settings, dict):
            raise TypeError("settings is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta} is damaged (not the JSON settings dflash.regenerate writes: {e}); it "
                        f"records the settings {out} was generated with: delete it to resume {out} with "
                        "this command's settings, or use another -o") from None
    return settings


def write_meta(meta: Path, obj: dict[str, Any]) -> None:
    """Write ``meta`` atomically and durably: a temporary file in the same directory, fsynced, then
    renamed over it, so a crash leaves the old file or the new one, never half of one."""
    tmp = meta.with_name(f".{meta.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, meta)
    finally:
        tmp.unlink(missing_ok=True)


def excluded_indices(path: Path) -> set[int]:
    """``source_index`` of every line of the JSONL ``path`` (``--exclude``).

    Raises:
        OSError: ``path`` cannot be read.
        DataError: a line is not a JSON object with an integer ``source_index``.
    """
    from dflash.data import DataError

    out: set[int] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            index = json.loads(line)["source_index"]
        except (ValueError, TypeError, KeyError):
            index = None
        if not isinstance(index, int) or isinstance(index, bool):
            raise DataError(f"--exclude {path} line {n}: expected a JSON object with an integer "
                            f"\"source_index\", got {line[:80]!r}")
        out.add(index)
    return out


def done_indices(path: Path) -> set[int]:
    """``source_index`` of every complete line of ``path``; a torn last line is cut off.

    The last line is torn when it has no newline (a kill in the middle of a write) or does not
    parse (a kill, then an editor or ``echo`` added the newline): it is truncated away.

    Raises:
        ValueError: a line before the last one is not a regenerate record.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    lines = data.split(b"\n")
    final = max((n for n, line in enumerate(lines) if line.strip()), default=-1)  # last non-blank
    keep, out = 0, set()
    for n, line in enumerate(lines):
        if line.strip():
            try:
                index = int(json.loads(line)["source_index"])
            except (ValueError, KeyError, TypeError) as e:
                if n == final:
                    break                           # the torn tail: cut below
                raise ValueError(f"{path}:{n + 1}: not a dflash.regenerate line ({e}); use another -o") from e
            if n == final == len(lines) - 1:
                break                               # parses, but no newline: the write was cut
            out.add(index)
        keep += len(line) + 1
    keep = min(keep, len(data))
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return out
