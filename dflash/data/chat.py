"""One conversation -> token ids + assistant loss mask, through the tokenizer's chat template.

Algorithm (works for any Jinja chat template that inserts each message's content once, in order,
possibly stripped; e.g. ChatML, Qwen3 with its ``<think>`` handling, Llama 3):

1. Render the conversation twice with ``apply_chat_template(..., tokenize=False)``: once as is,
   once with every message's content replaced by a unique sentinel (``\\ue000{i}\\ue001``).
   Splitting the sentinel rendering gives the template's own text between messages
   (``pieces[0] .. pieces[n]``); walking the real rendering against those pieces tells how the
   template wrote each content (verbatim or stripped) and proves the split is exact. A template
   that rewrites content any other way (e.g. Qwen3 moving a literal ``</think>`` into a reasoning
   block) gives the skip reason ``template_mismatch``.
2. Tokenize segment by segment: template pieces with special tokens recognised, message contents
   with special tokens encoded as plain text (so a user who writes ``<|im_end|>`` cannot inject a
   control token). For ChatML-style templates this gives the same ids as tokenizing the rendered
   string whole (the tests check it against transformers' ``{% generation %}`` mask).
3. Loss mask = the tokens of each trained assistant content plus the end-of-turn token: the first
   token of the following template piece when it is a special/added token (``<|im_end|>`` for
   ChatML/Qwen3, ``<|eot_id|>`` for Llama 3). Role headers and template text are never trained.
   With ``last_turn_only`` only the conversation's last assistant turn is trained.
4. Truncate to ``max_length`` tokens; drop (``too_few_loss_tokens``) when fewer than
   ``min_loss_tokens`` loss tokens remain.

This does not use ``return_assistant_tokens_mask`` because real Qwen3 templates have no
``{% generation %}`` tags; the tiny template has them and the tests compare both.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

from dflash.data.sources import Conversation
from dflash.data.tokenizer import check_tokenizer, special_token_ids

_SENTINEL = "\ue000{}\ue001"
_SPLIT = re.compile("\ue000(\\d+)\ue001")


class Encoded(NamedTuple):
    """A tokenized conversation.

    Attributes:
        ids: ``[L]`` int32 token ids, ``L <= max_length``.
        mask: ``[L]`` uint8, 1 on trained assistant tokens.
        truncated: True when the full conversation was longer than ``max_length``.
    """

    ids: np.ndarray
    mask: np.ndarray
    truncated: bool


def _forms(content: str) -> list[str]:
    """How a template may have written ``content``: verbatim first, then stripped variants."""
    forms = [content]
    for f in (content.strip(), content.lstrip(), content.rstrip(), content.lstrip("\n"),
              content.strip("\n"), content.rstrip("\n")):
        if f not in forms:
            forms.append(f)
    return forms


class ChatEncoder:
    """Encodes conversations with one tokenizer's chat template (see the module docstring).

    Args:
        tokenizer: a fast transformers tokenizer with a chat template.
        max_length: truncate to this many tokens.
        last_turn_only: train only the last assistant turn.
        min_loss_tokens: drop conversations with fewer loss tokens than this (``2 * block_size``).

    Raises:
        DataError: the tokenizer is not a fast tokenizer or has no chat template.
    """

    def __init__(self, tokenizer: Any, *, max_length: int, last_turn_only: bool = False,
                 min_loss_tokens: int = 0) -> None:
        check_tokenizer(tokenizer)
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer
        self.max_length = max_length
        self.last_turn_only = last_turn_only
        self.min_loss_tokens = min_loss_tokens
        self._templated = tokenizer.backend_tokenizer
        self._literal = Tokenizer.from_str(self._templated.to_str())
        self._literal.encode_special_tokens = True
        self._special = special_token_ids(tokenizer)
        self._piece_ids: dict[str, list[int]] = {}

    def render(self, messages: Conversation) -> tuple[list[str], list[str]] | str:
        """Template pieces (``n + 1``) and the form each content took (``n``), or a skip reason."""
        sentinels = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
        skeleton = self.tokenizer.apply_chat_template(sentinels, tokenize=False)
        parts = _SPLIT.split(skeleton)
        pieces, order = parts[0::2], parts[1::2]
        if order != [str(i) for i in range(len(messages))]:
            return "template_mismatch"
        real = self.tokenizer.apply_chat_template(messages, tokenize=False)
        if not real.startswith(pieces[0]):
            return "template_mismatch"
        pos, forms = len(pieces[0]), []
        for message, after in zip(messages, pieces[1:]):
            for form in _forms(message["content"]):
                if real.startswith(form, pos) and real.startswith(after, pos + len(form)):
                    break
            else:
                return "template_mismatch"
            forms.append(form)
            pos += len(form) + len(after)
        return (pieces, forms) if pos == len(real) else "template_mismatch"

    def _piece(self, text: str) -> list[int]:
        ids = self._piece_ids.get(text)
        if ids is None:
            ids = self._templated.encode(text, add_special_tokens=False).ids
            if len(self._piece_ids) < 4096:
                self._piece_ids[text] = ids
        return ids

    def encode_many(self, conversations: list[Conversation]) -> list[Encoded | str]:
        """Encode each conversation; a string in the output is that conversation's skip reason
        (``template_mismatch`` or ``too_few_loss_tokens``). Messages that start after
        ``max_length`` tokens are not tokenized at all."""
        out: list[Encoded | str] = []
        for conv in conversations:
            r = self.render(conv)
            if isinstance(r, str):
                out.append(r)
                continue
            pieces, forms = r
            assistant = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            trained = set(assistant[-1:] if self.last_turn_only else assistant)
            ids: list[int] = list(self._piece(pieces[0]))
            mask: list[int] = [0] * len(ids)
            cut_early = False
            for i, form in enumerate(forms):
                if len(ids) >= self.max_length:  # the rest would be truncated: skip tokenizing it
                    cut_early = True
                    break
                content = self._literal.encode(form, add_special_tokens=False).ids
                ids += content
                mask += [int(i in trained)] * len(content)
                after = self._piece(pieces[i + 1])
                ids += after
                mask += [0] * len(after)
                if i in trained and after and after[0] in self._special:
                    mask[len(ids) - len(after)] = 1
            truncated = cut_early or len(ids) > self.max_length
            ids_a = np.asarray(ids[: self.max_length], dtype=np.int32)
            mask_a = np.asarray(mask[: self.max_length], dtype=np.uint8)
            if int(mask_a.sum()) < max(self.min_loss_tokens, 1):
                out.append("too_few_loss_tokens")
            else:
                out.append(Encoded(ids_a, mask_a, truncated))
        return out

    def encode(self, conversation: Conversation) -> Encoded | str:
        """Encode one conversation (see :meth:`encode_many`)."""
        return self.encode_many([conversation])[0]
