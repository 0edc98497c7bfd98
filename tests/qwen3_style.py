"""A Qwen3-style test tokenizer: the tiny BPE with Qwen3's think handling, built offline.

What it shares with a real Qwen3 tokenizer: the chat template's think handling
(``tests/fixtures/qwen3_style_template.jinja``), ``<think>`` / ``</think>`` as added non-special
tokens, and the Qwen2 pre-tokenizer split (newline runs are one pre-token, so ``\\n\\n`` after
``</think>`` tokenizes the same alone as inside the whole rendered string). The vocabulary is the
tiny one.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from dflash.data.tokenizer import TINY_TOKENIZER_DIR

FIX = Path(__file__).parent / "fixtures"
TEMPLATE = (FIX / "qwen3_style_template.jinja").read_text()

# The pre-tokenizer regex of Qwen2/Qwen3 tokenizers (a public tokenizer.json setting).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@lru_cache(maxsize=None)
def _files(root: str) -> Path:
    out = Path(root)
    spec = json.loads((TINY_TOKENIZER_DIR / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    next_id = max(max(spec["model"]["vocab"].values()), max(t["id"] for t in spec["added_tokens"])) + 1
    for i, text in enumerate(("<think>", "</think>")):
        spec["added_tokens"].append({"id": next_id + i, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((TINY_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def qwen3_style_tokenizer(tmp_root: Path):
    """Load the Qwen3-style tokenizer, writing its files under ``tmp_root`` (a directory)."""
    from dflash.data import load_tokenizer

    tmp_root.mkdir(parents=True, exist_ok=True)
    return load_tokenizer(str(_files(str(tmp_root))))
