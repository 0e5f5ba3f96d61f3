"""Text <-> token ids for the gateway: the model's tokenizer and chat template, loaded once.

The fleet speaks token ids only; the gateway is where text becomes tokens and back, so every
replica and every trainer sees the same ids the caller's text was turned into. Routes that take
token ids (``/v1/completions/tokens``) never touch the tokenizer: an RL agent that tokenizes
itself pays nothing for it here.

Encoding and decoding go straight to the Rust ``tokenizers`` backend of a fast tokenizer when
that is exactly equivalent (it is what the Python wrapper calls anyway, minus ~70 us of Python per
call); a slow tokenizer, or one that post-processes decoded text (``clean_up_tokenization_spaces``),
goes through the wrapper.

Streaming replays a finished result, so text is produced by decoding growing prefixes and sending
the new suffix; a prefix that ends inside a multi-byte character (the decoder yields U+FFFD) is
held back until the next chunk completes it, and the chunks always add up to the full text.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional, Sequence

from rollfleet.gateway.errors import GatewayError, bad_request

_REPLACEMENT = "\ufffd"


class TextCodec:
    """A Hugging Face tokenizer with the few operations the gateway needs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        #: Every id the tokenizer can produce or decode (base vocabulary + added tokens).
        self.vocab_size: int = len(tokenizer)
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        self.has_chat_template: bool = bool(getattr(tokenizer, "chat_template", None))
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._backend = backend
        self._backend_decode = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters (byte-level vocabularies write one character per
        byte, so no token decodes to more characters than its vocabulary entry has)."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    def min_tokens(self, chars: int) -> int:
        """The fewest tokens a text of ``chars`` characters can become: how the gateway refuses a
        prompt that cannot fit the context before paying to tokenize it (the tokenizer holds the
        GIL, so a 10 MB prompt would stall every other request for seconds)."""
        return -(-chars // self.max_token_chars)

    @classmethod
    def load(cls, path: str) -> "TextCodec":
        """Load the tokenizer of a local model folder (a built-in name is built first)."""
        from transformers import AutoTokenizer

        from rollfleet.models import get_model_path

        return cls(AutoTokenizer.from_pretrained(get_model_path(path)))

    # ------------------------------------------------------------------ text -> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; ``add_special_tokens`` adds what the tokenizer adds by itself (BOS...)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Messages -> prompt ids through the model's own chat template (``options``: those of
        :meth:`render_chat_text`)."""
        return self.encode(self.render_chat_text(messages, **options), add_special_tokens=False)

    def render_chat_text(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: Optional[list[dict[str, Any]]] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Optional[dict[str, Any]] = None,
    ) -> str:
        """Messages -> the prompt text the model's chat template writes."""
        if not self.has_chat_template:
            raise GatewayError(
                400, "this model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
            )
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # they contradict; continuing the last message wins
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **(template_kwargs or {}),
                )
            )
        except Exception as exc:  # jinja raised on these messages: the caller's input
            raise bad_request(
                "messages", f"the chat template rejected the messages: {type(exc).__name__}: {exc}"
            ) from exc

    @functools.cached_property
    def eos_text(self) -> Optional[str]:
        """The end-of-turn token as the chat template writes it (``<|im_end|>``), if it has one."""
        token = getattr(self.tokenizer, "eos_token", None)
        return token if isinstance(token, str) and token else None

    def stop_token_ids(self, stops: Sequence[str], *, indexed: bool = True) -> list[int]:
        """Stop strings the fleet can honour: each must be exactly one token of the vocabulary.

        The fleet stops on token ids; stopping on an arbitrary string would need the text of the
        response while it is generated, and cutting the text afterwards would make the returned
        tokens disagree with the text, which an RL trainer must never see.
        """
        ids = []
        for i, stop in enumerate(stops):
            tok = self.encode(stop, add_special_tokens=False)
            if len(tok) != 1:
                raise bad_request(
                    f"stop[{i}]" if indexed else "stop",
                    f"stop string {stop!r} is {len(tok)} tokens; only single-token stop strings are supported "
                    "(or pass stop_token_ids)",
                    code="unsupported_value",
                )
            ids.append(tok[0])
        return ids

    # ------------------------------------------------------------------ ids -> text
    def decode(self, ids: Sequence[int]) -> str:
        if self._backend_decode and self._backend is not None:  # the first implies the second
            return self._backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """The text of each token on its own (for OpenAI logprobs' ``tokens`` / ``token``)."""
        decode = self._backend.decode if self._backend_decode and self._backend is not None else self.tokenizer.decode
        return [decode([i]) for i in ids]

    def pieces(self, ids: Sequence[int], chunk_tokens: int) -> Iterator[tuple[str, int, int]]:
        """``(text, start, end)`` per chunk of about ``chunk_tokens`` tokens; texts add up to
        ``decode(ids)`` exactly."""
        full = self.decode(ids)
        sent = 0
        start = 0
        n = len(ids)
        end = 0
        while end < n:
            end = min(n, end + chunk_tokens)
            if end == n:
                text = full
            else:
                text = self.decode(ids[:end])
                if text.endswith(_REPLACEMENT) or not full.startswith(text):
                    continue  # mid-character or the decoder re-joined text: wait for more tokens
            yield text[sent:], start, end
            sent = len(text)
            start = end


__all__ = ["TextCodec"]
