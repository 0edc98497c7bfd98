"""Rendering with a tokenizer's chat template, for :mod:`dflash.data.chat`: the template's
compiled renderer (the fast path, checked against ``apply_chat_template`` by its caller) and the
forms a template may have written a message's text in (verbatim, or stripped as templates do).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["compiled_renderer", "written_forms"]


def written_forms(text: str) -> Iterator[str]:
    """How a template may have written ``text``: verbatim first, then stripped variants."""
    yield text
    seen = [text]
    for f in (text.strip(), text.lstrip(), text.rstrip(), text.lstrip("\n"), text.strip("\n"),
              text.rstrip("\n")):
        if f not in seen:
            seen.append(f)
            yield f


def compiled_renderer(tokenizer: PreTrainedTokenizerBase):
    """A function rendering messages with the tokenizer's compiled chat template, skipping
    ``apply_chat_template``'s per-call normalisation (a no-op for the plain string dicts built
    here), or None when transformers does not expose its compiled-template cache. The caller
    checks it against ``apply_chat_template`` before trusting it."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(tokenizer.get_chat_template())
        kwargs = dict(tokenizer.special_tokens_map)
    except Exception:  # noqa: BLE001 - any failure means: use the public path
        return None

    def render(messages: list[dict]) -> str:
        return compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=False,
                               **kwargs)

    return render
