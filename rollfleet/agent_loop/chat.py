"""Token-level conversation building over a tokenizer's chat template.

A multi-turn trajectory is kept as token ids, never re-rendered: the model's own tokens are
appended as generated (re-tokenising decoded text would not give back the same ids, and the
trainer must see exactly the tokens that were sampled). Messages the loop adds (tool results,
user turns) are rendered with the chat template and only the **delta** is tokenised: the template
renders a fixed short conversation ending with an assistant message, then the same conversation
plus the new messages, and the text after the first rendering is what the new messages add.

Boundary: the template closes an assistant message with its end-of-turn token plus a tail (``"\\n"``
for ChatML). The model's output stops at the end-of-turn token, so the tail (and the end-of-turn
token itself, when the model stopped on something else) is prepended to the delta. These boundary
tokens are not the model's: they get mask 0, like the rest of the delta.

Trade-off: the delta is tokenised on its own, so a BPE merge across the boundary is not
reproduced; chat templates put special tokens at message boundaries, which makes this exact for
ChatML-style templates.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

_BASE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "?"}]


class ChatTemplateError(ValueError):
    """The chat template cannot be extended message by message (its rendering is not prefix-stable)."""


class ChatRenderer:
    """Renders prompts and message deltas to token ids with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token or ""
        self._base_cache: dict[tuple[str, ...], tuple[str, str]] = {}
        self._head_cache: dict[tuple[str, ...], str] = {}

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Optional[list[dict]] = None,
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Optional[list[dict]] = None) -> list[int]:
        """The prompt of a conversation, ending with the template's generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def delta_ids(
        self,
        new_messages: Sequence[dict[str, Any]],
        tools: Optional[list[dict]] = None,
        *,
        last_token_id: Optional[int] = None,
    ) -> list[int]:
        """Token ids that append ``new_messages`` (and the next generation prompt) after an
        assistant turn whose last token is ``last_token_id``.

        The delta is what follows the base's assistant turn in the longer conversation, up to its
        end-of-turn token: not what follows the base rendered alone, where its assistant message
        is the last one, which some templates render otherwise (Qwen3's adds an empty think block
        to the last assistant message only: every tool round failed as not prefix-stable)."""
        full = self.render([*_BASE, *new_messages], tools, add_generation_prompt=True)
        if self.eos_text:
            head = self._head(tools)
            end = full.find(self.eos_text, len(head)) if full.startswith(head) else -1
            if end < 0:
                raise ChatTemplateError(
                    "the chat template renders a conversation differently once messages are appended; "
                    "multi-turn token deltas need a prefix-stable template"
                )
            rest = full[end + len(self.eos_text) :]
            return self.encode(rest if last_token_id == self.eos_token_id else self.eos_text + rest)
        base_text, tail = self._base(tools)
        if not full.startswith(base_text):
            raise ChatTemplateError(
                "the chat template renders a conversation differently once messages are appended; "
                "multi-turn token deltas need a prefix-stable template"
            )
        boundary = tail if last_token_id == self.eos_token_id else self.eos_text + tail
        return self.encode(boundary + full[len(base_text) :])

    def _head(self, tools: Optional[list[dict]]) -> str:
        """The base's first message (and the tools' system block) as it renders: a prefix of any
        longer conversation."""
        key = _tools_key(tools)
        cached = self._head_cache.get(key)
        if cached is None:
            cached = self._head_cache[key] = self.render(_BASE[:1], tools)
        return cached

    def _base(self, tools: Optional[list[dict]]) -> tuple[str, str]:
        key = _tools_key(tools)
        cached = self._base_cache.get(key)
        if cached is None:
            base_text = self.render(_BASE, tools)
            idx = base_text.rfind(self.eos_text) if self.eos_text else -1
            tail = base_text[idx + len(self.eos_text) :] if idx >= 0 else ""
            cached = self._base_cache[key] = (base_text, tail)
        return cached


def _tools_key(tools: Optional[list[dict]]) -> tuple[str, ...]:
    """What a cached rendering depends on beside the fixed base: the tools' names."""
    return tuple(t.get("function", t).get("name", "") for t in tools) if tools else ()


__all__ = ["ChatRenderer", "ChatTemplateError"]
