"""Conversations -> token ids + assistant loss mask, through the tokenizer's chat template.

Algorithm (works for any Jinja chat template that inserts each message's content, and its
reasoning, once, in order, possibly stripped; e.g. ChatML, Qwen3 with its ``<think>`` handling,
Llama 3):

1. *Skeleton*, once per conversation structure (the roles, and which messages carry reasoning):
   render the conversation with every content and reasoning replaced by a unique sentinel
   (``\\ue000c3\\ue001``, ``\\ue000r3\\ue001``). Splitting it gives the template's own text between
   the segments (``pieces[0] .. pieces[n]``) and the order it writes them in. The sentinel
   conversation depends on the structure only, so the skeleton is cached by structure.
2. *Check*, per conversation: render the real conversation and walk it against the skeleton's
   pieces; this tells how the template wrote each segment (verbatim or stripped) and proves the
   split exact. A template that rewrites a segment any other way gives the skip reason
   ``template_mismatch``; one that raises (e.g. on a role order it rejects), ``template_error``.
3. *Tokenize* segment by segment, batched over many conversations with ``encode_batch`` (Rust,
   every core): template pieces with special tokens recognised, contents and reasoning with
   special tokens encoded as plain text (a user who writes ``<|im_end|>`` cannot inject a control
   token). For ChatML-style templates this gives the same ids as tokenizing the rendered string
   whole (the tests check it against transformers' ``{% generation %}`` mask). Segments that start
   after ``max_length`` tokens are not tokenized.
4. *Loss mask* = the tokens of each trained assistant content plus the end-of-turn token: the first
   token of the following template piece when it is a special/added token (``<|im_end|>`` for
   ChatML/Qwen3, ``<|eot_id|>`` for Llama 3). Role headers and template text are never trained.
   With ``last_turn_only`` only the conversation's last assistant turn is trained.
5. Truncate to ``max_length`` tokens; drop (``too_few_loss_tokens``) when fewer than
   ``min_loss_tokens`` loss tokens remain.

Reasoning (``reasoning_content``, see :mod:`dflash.data.sources`), by ``reasoning``:

* ``"train"``: rendered and trained, with the template text between reasoning and answer
  (``\\n</think>\\n\\n`` for Qwen3), which the model generates. The opening ``<think>\\n`` belongs to
  the turn header, so a trained reasoning turn's context ends in ``assistant\\n<think>\\n``.
* ``"context"``: rendered, not trained; the answer is trained.
* ``"drop"``: removed before rendering.

A template that reads ``reasoning_content`` (Qwen3) gets it as that field; one that does not
(ChatML) gets it inline, ``<think>\\nREASONING\\n</think>\\n\\nANSWER``, the form reasoning models
generate. A template may still leave reasoning out: Qwen3 shows only the reasoning of turns after
the last user turn. Each turn whose reasoning is not in the tokens is counted
(``Encoded.reasoning_dropped``); the conversation is kept.

This does not use ``return_assistant_tokens_mask`` because real Qwen3 templates have no
``{% generation %}`` tags; the tiny template and the tests' Qwen3-style template have them and the
tests compare both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import chain, islice
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
from jinja2 import TemplateError

from dflash.data.chat_render import compiled_renderer, written_forms
from dflash.data.sources import THINK_CLOSE, THINK_OPEN, Conversation
from dflash.data.tokenizer import check_tokenizer, special_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Reasoning = Literal["train", "context", "drop"]

_SENTINEL = "\ue000{}\ue001"
_SPLIT = re.compile("\ue000([cr]\\d+)\ue001")
_MISMATCH = "template_mismatch"
_TEMPLATE_ERROR = "template_error"


class Encoded(NamedTuple):
    """A tokenized conversation.

    Attributes:
        ids: ``[L]`` int32 token ids, ``L <= max_length``.
        mask: ``[L]`` uint8, 1 on trained tokens.
        truncated: True when the full conversation was longer than ``max_length``.
        reasoning_turns: assistant turns that carry reasoning.
        reasoning_dropped: of those, turns whose reasoning is not in ``ids`` (removed by
            ``reasoning = "drop"`` or left out by the chat template).
        full_length: tokens of the whole conversation, in tokens: exact when every segment was
            tokenized, else estimated from its characters at the tokens per character of its
            tokenized part (segments past ``max_length`` are not tokenized; 0: unknown).
    """

    ids: np.ndarray
    mask: np.ndarray
    truncated: bool
    reasoning_turns: int = 0
    reasoning_dropped: int = 0
    full_length: int = 0


class _Skeleton(NamedTuple):
    """What the template writes around the segments of one conversation structure."""

    pieces: list[str]               # n + 1 template texts around the n segments
    segments: list[tuple[str, int]]  # ("r" | "c", message index), in rendering order
    unrendered: int                 # messages whose reasoning the template left out


class _Plan(NamedTuple):
    """One conversation, checked against its skeleton, ready to tokenize."""

    pieces: list[str]
    forms: list[str]     # the text of each segment as the template wrote it
    trained: list[bool]  # per segment
    glued: list[bool]    # per segment: the piece after it is trained too (reasoning -> answer)
    ended: list[bool]    # per segment: its end-of-turn token (first token after it) is trained
    reasoning_turns: int
    reasoning_dropped: int


class ChatEncoder:
    """Encodes conversations with one tokenizer's chat template (see the module docstring).

    Args:
        tokenizer: a fast transformers tokenizer with a chat template.
        max_length: truncate to this many tokens.
        last_turn_only: train only the last assistant turn.
        min_loss_tokens: drop conversations with fewer loss tokens than this (``2 * block_size``).
        reasoning: "train" | "context" | "drop" (module docstring).

    Raises:
        DataError: the tokenizer is not a fast tokenizer or has no chat template.

    Thread-safe: :meth:`encode_many` may run in several threads at once (its ``encode_batch``
    calls release the GIL).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, max_length: int, last_turn_only: bool = False,
                 min_loss_tokens: int = 0, reasoning: Reasoning = "train") -> None:
        check_tokenizer(tokenizer)
        from tokenizers import Tokenizer

        if reasoning not in ("train", "context", "drop"):
            raise ValueError(f"reasoning must be 'train', 'context' or 'drop', not {reasoning!r}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.last_turn_only = last_turn_only
        self.min_loss_tokens = min_loss_tokens
        self.reasoning = reasoning
        self._templated = tokenizer.backend_tokenizer
        self._literal = Tokenizer.from_str(self._templated.to_str())
        self._literal.encode_special_tokens = True
        self._literal.no_padding()
        self._literal.no_truncation()
        # same ids as encode_batch, without computing offsets (about 2x faster); tokenizers >= 0.21
        self._encode_batch = getattr(self._literal, "encode_batch_fast", self._literal.encode_batch)
        self._special = special_token_ids(tokenizer)
        self._piece_ids: dict[str, list[int]] = {}
        self._skeletons: dict[tuple, _Skeleton | str] = {}
        self._fast = compiled_renderer(tokenizer)
        self._checked: set[tuple] = set()  # structures whose fast rendering was compared once
        self._field = self._reads_reasoning_field()

    # -- rendering -------------------------------------------------------------------------------

    def _slow_render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def _render(self, key: tuple, messages: list[dict]) -> str:
        """``apply_chat_template(messages, tokenize=False)``, through the compiled template when it
        gave the same text for the first conversation of this structure."""
        if self._fast is None:
            return self._slow_render(messages)
        text = self._fast(messages)
        if key not in self._checked:
            if text != self._slow_render(messages):
                self._fast = None
                return self._slow_render(messages)
            self._checked.add(key)
        return text

    def _message(self, m: dict, content: str, reasoning: str | None) -> dict:
        """The message handed to the template: reasoning as a field (aliased as transformers does)
        or inline before the answer."""
        if reasoning is None:
            return {"role": m["role"], "content": content}
        if self._field:
            return {"thinking": reasoning, "role": m["role"], "content": content, "reasoning_content": reasoning}
        return {"role": m["role"], "content": f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"}

    def _reads_reasoning_field(self) -> bool:
        probe = [{"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a", "reasoning_content": _SENTINEL.format("r1")}]
        try:
            return _SENTINEL.format("r1") in self._slow_render(probe)
        except Exception:  # noqa: BLE001 - a template that rejects the probe cannot take the field
            return False

    def _skeleton(self, key: tuple, conv: Conversation) -> _Skeleton | str:
        sk = self._skeletons.get(key)
        if sk is not None:
            return sk
        messages = [self._message(m, _SENTINEL.format(f"c{i}"), _SENTINEL.format(f"r{i}") if r else None)
                    for i, (m, (_, r)) in enumerate(zip(conv, key))]
        try:
            parts = _SPLIT.split(self._slow_render(messages))
        except TemplateError:  # e.g. "roles must alternate user/assistant"
            self._skeletons[key] = _TEMPLATE_ERROR
            return _TEMPLATE_ERROR
        names = parts[1::2]
        segments: list[tuple[str, int]] = []
        expect = [(("r", i),) * r + (("c", i),) for i, (_, r) in enumerate(key)]
        unrendered = 0
        pos = 0
        for i, want in enumerate(expect):
            got = tuple((n[0], int(n[1:])) for n in names[pos: pos + len(want)])
            if got != want and want[0][0] == "r" and tuple(got[:1]) == want[1:]:
                got, want = got[:1], want[1:]  # the template left this message's reasoning out
                unrendered += 1
            if got != want:
                sk = _MISMATCH
                break
            segments += want
            pos += len(want)
        else:
            sk = _Skeleton(parts[0::2], segments, unrendered) if pos == len(names) else _MISMATCH
        if len(self._skeletons) < 4096:
            self._skeletons[key] = sk
        return sk

    def _plan(self, conv: Conversation) -> _Plan | str:
        reasoned = sum(1 for m in conv if "reasoning_content" in m)
        keep = self.reasoning != "drop"
        key = tuple((m["role"], keep and "reasoning_content" in m) for m in conv)
        sk = self._skeleton(key, conv)
        if isinstance(sk, str):
            return sk
        messages = conv if not reasoned else [  # as given, like apply_chat_template(conv)
            self._message(m, m["content"], m.get("reasoning_content") if keep else None) for m in conv]
        try:
            real = self._render(key, messages)
        except TemplateError:
            return _TEMPLATE_ERROR
        pieces = sk.pieces
        if not real.startswith(pieces[0]):
            return _MISMATCH
        assistant = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        trained_msgs = set(assistant[-1:] if self.last_turn_only else assistant)
        pos = len(pieces[0])
        forms: list[str] = []
        trained: list[bool] = []
        glued: list[bool] = []
        ended: list[bool] = []
        for (kind, i), after in zip(sk.segments, pieces[1:]):
            m = conv[i]
            text = m["content"] if kind == "c" else m["reasoning_content"]
            if real.startswith(text, pos) and real.startswith(after, pos + len(text)):
                form = text  # the common case, without building the stripped variants
            else:
                for form in written_forms(text):
                    if real.startswith(form, pos) and real.startswith(after, pos + len(form)):
                        break
                else:
                    return _MISMATCH
            forms.append(form)
            pos += len(form) + len(after)
            on = i in trained_msgs and (kind == "c" or self.reasoning == "train")
            trained.append(on)
            glued.append(on and kind == "r")
            ended.append(on and kind == "c")
        if pos != len(real):
            return _MISMATCH
        dropped = reasoned if not keep else sk.unrendered
        return _Plan(pieces, forms, trained, glued, ended, reasoned, dropped)

    # -- tokenizing ------------------------------------------------------------------------------

    def _piece(self, text: str) -> list[int]:
        ids = self._piece_ids.get(text)
        if ids is None:
            ids = self._templated.encode(text, add_special_tokens=False).ids
            if len(self._piece_ids) < 4096:
                self._piece_ids[text] = ids
        return ids

    def encode_many(self, conversations: list[Conversation]) -> list[Encoded | str]:
        """Encode each conversation; a string in the output is that conversation's skip reason
        (``template_mismatch``, ``template_error``: the template raised, e.g. on a role order it
        rejects, or ``too_few_loss_tokens``). Segments that start after
        ``max_length`` tokens are not tokenized at all.

        The segments of all conversations are tokenized in rounds (round ``k``: the ``k``-th
        segment of every conversation still shorter than ``max_length``), one ``encode_batch``
        per round.
        """
        out: list[Encoded | str | None] = [None] * len(conversations)
        plans: list[tuple[int, _Plan, list[list[int]]]] = []
        for j, conv in enumerate(conversations):
            p = self._plan(conv)
            if isinstance(p, str):
                out[j] = p
            else:
                plans.append((j, p, [self._piece(x) for x in p.pieces]))
        limit = self.max_length
        seqs = [list(piece_ids[0]) for _, _, piece_ids in plans]  # ids so far
        lens = [[len(x)] for x in seqs]  # token count of piece 0, segment 0, piece 1, ...
        cut = [len(x) >= limit for x in seqs]
        active = [a for a, (_, p, _) in enumerate(plans) if p.forms and not cut[a]]
        k = 0
        while active:
            batch = self._encode_batch([plans[a][1].forms[k] for a in active], add_special_tokens=False)
            nxt = []
            for a, enc in zip(active, batch):
                content = enc.ids
                after = plans[a][2][k + 1]
                seq = seqs[a]
                seq += content
                seq += after
                lens[a] += (len(content), len(after))
                if k + 1 < len(plans[a][1].forms):
                    if len(seq) >= limit:
                        cut[a] = True
                    else:
                        nxt.append(a)
            active = nxt
            k += 1
        if not plans:
            return out  # type: ignore[return-value]
        # assemble all conversations at once: flat ids and mask, then one view per conversation
        runs = np.fromiter(chain.from_iterable(lens), np.int64)
        values = np.fromiter(chain.from_iterable(_run_values(p, len(n)) for (_, p, _), n in zip(plans, lens)),
                             np.uint8, len(runs))
        mask = np.repeat(values, runs)
        run_start = np.cumsum(runs) - runs
        first_run = np.cumsum([0] + [len(n) for n in lens[:-1]])
        ends = [first_run[a] + 2 * s + 2 for a, ((_, p, piece_ids), n) in enumerate(zip(plans, lens))
                for s in range(len(n) // 2)
                if p.ended[s] and piece_ids[s + 1] and piece_ids[s + 1][0] in self._special]
        mask[run_start[ends]] = 1  # the end-of-turn token: first token of the piece after a trained content
        sizes = np.fromiter((len(x) for x in seqs), np.int64, len(seqs))
        starts = np.cumsum(sizes) - sizes
        kept = np.minimum(sizes, limit)
        ids = np.fromiter(chain.from_iterable(seqs), np.int32, int(sizes.sum()))
        bounds = np.stack([starts, starts + kept], 1).ravel()  # [start, end) of each kept span
        loss = np.add.reduceat(np.append(mask, np.uint8(0)), bounds, dtype=np.int64)[::2]
        loss[kept == 0] = 0
        need = max(self.min_loss_tokens, 1)
        for a, (j, p, _) in enumerate(plans):
            if loss[a] < need:
                out[j] = "too_few_loss_tokens"
                continue
            s0, s1 = int(starts[a]), int(starts[a] + kept[a])
            out[j] = Encoded(ids[s0:s1], mask[s0:s1], cut[a] or bool(sizes[a] > limit), p.reasoning_turns,
                             p.reasoning_dropped, _full_length(p, (len(lens[a]) - 1) // 2, int(sizes[a])))
        return out  # type: ignore[return-value]

    def encode(self, conversation: Conversation) -> Encoded | str:
        """Encode one conversation (see :meth:`encode_many`)."""
        return self.encode_many([conversation])[0]

    def context(self, conversation: Conversation) -> np.ndarray | str:
        """``[P]`` int32 ids before the conversation's first trained token: the context training
        gives the drafter there (what ``TokenizedDataset.prompt`` returns), or a skip reason."""
        e = self.encode(conversation)
        if isinstance(e, str):
            return e
        return e.ids[: int(np.argmax(e.mask))]


def _full_length(plan: _Plan, done: int, tokens: int) -> int:
    """Tokens of the whole conversation whose first ``done`` segments (and the pieces around them)
    gave ``tokens``: exact when every segment was tokenized, else scaled by characters (the
    segments past ``max_length`` are never tokenized: tokenizing them would cost more than the
    data summary's "by how much" is worth)."""
    if done == len(plan.forms):
        return tokens

    def chars(n: int) -> int:
        return len(plan.pieces[0]) + sum(len(plan.forms[i]) + len(plan.pieces[i + 1]) for i in range(n))

    return max(tokens, round(tokens * chars(len(plan.forms)) / max(chars(done), 1)))


def _run_values(plan: _Plan, runs: int) -> Iterator[int]:
    """Mask value of each run (piece 0, segment 0, piece 1, ...) of the first ``runs`` runs."""
    yield 0
    for trained, glued in islice(zip(plan.trained, plan.glued), runs // 2):
        yield trained
        yield glued
