"""A GGUF file's metadata and tokenizer, read and checked for ``python -m dflash.import_gguf``.

transformers converts a GGUF file's tokenizer itself, and some versions convert it wrongly (4.x
takes a byte-level BPE ``llama`` file for SentencePiece; 5.17 takes SmolLM2's ``<|im_start|>`` for
its eos): :func:`check_tokenizer` compares the conversion with the ids the file states, and
:func:`given_tokenizer` loads a ``--tokenizer`` directory instead, once :func:`check_vocabulary`
finds every token of the file at the same id there. :func:`write_tokenizer` writes the two files
both transformers lines load. Reading uses the ``gguf`` package (the ``gguf`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ImportRefused", "check_tokenizer", "check_vocabulary", "gguf_metadata", "gguf_vocabulary",
           "given_tokenizer", "write_tokenizer"]


class ImportRefused(Exception):
    """Bad input, said in one line (exit 2)."""


def gguf_metadata(path: Path) -> dict:
    """The scalar metadata of a GGUF file (``general.architecture``, ``tokenizer.ggml.eos_token_id``,
    ...; arrays such as the vocabulary are left out), read with the ``gguf`` package."""
    from gguf import GGUFReader, GGUFValueType

    out = {}
    for key, field in GGUFReader(str(path)).fields.items():
        if not field.types or field.types[0] == GGUFValueType.ARRAY or not field.data:
            continue
        part = field.parts[field.data[0]]
        out[key] = bytes(part).decode("utf-8") if field.types[0] == GGUFValueType.STRING else part.tolist()[0]
    return out


def gguf_vocabulary(path: Path) -> list[str]:
    """The file's vocabulary, ``tokenizer.ggml.tokens`` (token strings in id order; empty if absent)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def check_vocabulary(tok, tokens: list[str], where: str) -> None:
    """Every token of the file's vocabulary has the same id in ``tok`` (a tokenizer given with
    ``--tokenizer``), so the weights' embedding rows mean the same tokens.

    Raises:
        ImportRefused: the file states no vocabulary, or ``tok`` differs (the first differing id named).
    """
    if not tokens:
        raise ImportRefused(f"the GGUF file states no vocabulary (tokenizer.ggml.tokens), so --tokenizer {where} "
                            "cannot be checked against it; import without --tokenizer")
    got = tok.convert_ids_to_tokens(list(range(len(tokens))))
    for i, (want, have) in enumerate(zip(tokens, got)):
        if want != have:
            raise ImportRefused(f"--tokenizer {where} is not this model's tokenizer: id {i} is {have!r} there and "
                                f"{want!r} in the GGUF file; give the directory of the model the file was made from")


def given_tokenizer(where: str, src: Path, meta: dict):
    """``--tokenizer DIR`` loaded and checked against the file (vocabulary, special tokens); the
    file's chat template where DIR has none."""
    from transformers import AutoTokenizer

    d = Path(where)
    if not (d / "tokenizer.json").is_file() or not (d / "tokenizer_config.json").is_file():
        raise ImportRefused(f"--tokenizer {where}: no tokenizer.json and tokenizer_config.json there; give a "
                            "directory holding both (a Hugging Face model directory)")
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    check_vocabulary(tok, gguf_vocabulary(src), where)
    check_tokenizer(tok, meta)
    if not tok.chat_template and meta.get("tokenizer.chat_template"):
        tok.chat_template = meta["tokenizer.chat_template"]
    return tok


def check_tokenizer(tok, meta: dict) -> None:
    """The converted tokenizer against what the GGUF file states: its eos and bos ids, and whether a
    bos is added to every text (``tokenizer.ggml.add_bos_token``).

    Raises:
        ImportRefused: they differ (transformers 4.x on a byte-level BPE ``llama`` file).
    """
    import transformers

    problems = []
    for role in ("eos", "bos"):
        want = meta.get(f"tokenizer.ggml.{role}_token_id")
        got = getattr(tok, f"{role}_token_id")
        if want is not None and got != want:
            problems.append(f"{role} is {getattr(tok, f'{role}_token')!r} ({got}), the file says "
                            f"{tok.convert_ids_to_tokens(want)!r} ({want})")
    adds = tok("x")["input_ids"][:1] == [tok.bos_token_id] and tok.bos_token_id is not None
    if adds != bool(meta.get("tokenizer.ggml.add_bos_token", False)):
        problems.append(f"it {'adds' if adds else 'does not add'} {tok.bos_token!r} before every text, the file "
                        f"says add_bos_token = {bool(meta.get('tokenizer.ggml.add_bos_token', False))}")
    if problems:
        raise ImportRefused(f"transformers {transformers.__version__} converts this file's tokenizer wrongly "
                            f"({'; '.join(problems)}); import with a transformers that converts it correctly "
                            "(5.25 does for SmolLM2; the directory it writes loads under 4.x too), or give "
                            "--tokenizer DIR with the model's own tokenizer files")


def write_tokenizer(tok, out: Path, max_length: int) -> None:
    """``tokenizer.json`` (the converted fast tokenizer) and a ``tokenizer_config.json`` that
    transformers 4.x and 5.x both load (special tokens, the chat template, no class of 5.x only)."""
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers",
              "chat_template": tok.chat_template, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length}
    for role in ("bos", "eos", "unk", "pad"):
        token = getattr(tok, f"{role}_token")
        if token is not None:
            config[f"{role}_token"] = str(token)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
