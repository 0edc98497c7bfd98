"""Multi-turn prompts for ``dflash.eval``: turn ``t + 1`` of a prompt is asked after the target's
own answer to turns ``0..t``, as MT-Bench's second turn is asked (the judge protocol of Zheng et al.
2023 asks it after the model's own first answer; SpecForge and the DFlash paper decode it so).

The greedy draft-and-verify output equals the target's greedy output, so the answer fed back is
the target's own. It is cut at the first end-of-turn token (the tokenizer's EOS, and ``<|im_end|>``
where the vocabulary has it) and decoded without special tokens, then the conversation is encoded
as training encodes contexts (:func:`dflash.data.prompts.encode_prompt`, the run's ``[data]``
settings), keeping the last ``max_prompt_tokens`` tokens.
"""

from __future__ import annotations

import torch

from dflash.data.prompts import encode_prompt
from dflash.eval.sets import EvalPrompt

__all__ = ["Turns", "stratified"]


def stratified(prompts: list[EvalPrompt], n: int) -> list[EvalPrompt]:
    """``n`` prompts taking one from each category in turn (first-seen category order, file order
    within a category), so a subset of MT-Bench covers every category instead of the first one."""
    by_cat: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[EvalPrompt] = []
    depth = 0
    while len(out) < min(n, len(prompts)):
        out += [ps[depth] for ps in by_cat.values() if depth < len(ps)][: n - len(out)]
        depth += 1
    return out


class Turns:
    """The prompts of a set as token ids, and the ``next_turn`` callback of
    :func:`dflash.eval.measure.evaluate` that builds a later turn from the target's answer.

    Args:
        tok: the target's tokenizer.
        prompts: the set's prompts (each one or more user turns).
        max_prompt_tokens: prompt tokens kept (the last ones).
        data_cfg: the run's ``[data]`` table (the chat-template settings training used), or None.
        device: where the prompt tensors go.

    Raises (from :meth:`first` and calls):
        DataError: a chat template the data path cannot split.
    """

    def __init__(self, tok, prompts: list[EvalPrompt], max_prompt_tokens: int, data_cfg, device) -> None:
        self.tok, self.prompts, self.max_tokens = tok, prompts, max_prompt_tokens
        self.data_cfg, self.device = data_cfg, device
        self.history: list[list[dict]] = [[] for _ in prompts]
        self.prompt_len = [0] * len(prompts)  # tokens of each prompt's latest prompt ids
        ends = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None, tok.unk_token_id}
        self.ends = {int(e) for e in ends}

    def _ids(self, i: int, turn: int) -> torch.Tensor:
        self.history[i].append({"role": "user", "content": self.prompts[i].turns[turn]})
        ids = encode_prompt(self.tok, self.history[i], self.max_tokens, self.data_cfg)
        self.prompt_len[i] = len(ids)
        return torch.tensor(ids, device=self.device)

    def first(self) -> list[torch.Tensor]:
        """The first turn of every prompt, as ``[n]`` int64 token ids."""
        return [self._ids(i, 0) for i in range(len(self.prompts))]

    def answer(self, generated: list[int]) -> str:
        """The text of a generated reply, cut before its first end-of-turn token."""
        cut = next((k for k, t in enumerate(generated) if t in self.ends), len(generated))
        return self.tok.decode(generated[:cut], skip_special_tokens=True)

    def __call__(self, i: int, turn: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """Prompt ``i``'s turn ``turn + 1`` after the reply in ``tokens`` (its prompt, then the
        reply), or None when the prompt has no further turn."""
        if turn + 1 >= len(self.prompts[i].turns):
            return None
        reply = tokens[self.prompt_len[i]:].tolist()
        self.history[i].append({"role": "assistant", "content": self.answer(reply)})
        return self._ids(i, turn + 1)
