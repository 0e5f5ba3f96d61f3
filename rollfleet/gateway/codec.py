"""Text <-> token ids for the gateway: the model's tokenizer and chat template, loaded once.

The fleet speaks token ids only; the gateway is where text becomes tokens and back, so every
replica and every trainer sees the same ids the caller's text was turned into. Routes that take
token ids (``/v1/completions/tokens``) never touch the tokenizer: an RL agent that tokenizes
itself pays nothing for it here.

Encoding and decoding go straight to the Rust ``tokenizers`` backend of a fast tokenizer when
that is exactly equivalent (it is what the Python wrapper calls anyway, minus ~70 us of Python per
call); a slow tokenizer, or one that post-processes decoded text (``clean_up_tokenization_spaces``),
goes through the wrapper.

Streamed text (live or replayed) comes from one :class:`IncrementalDecoder`: each step decodes a
short window of ids, not all of them again, and the pieces add up to the full text.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional, Sequence

from rollfleet.gateway.errors import GatewayError, bad_request

_REPLACEMENT = "\ufffd"
#: Tokens that write text a character still open may span (its 3 bytes after the first).
_OPEN_TOKENS = 3


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
    def knows_developer_role(self) -> bool:
        """Whether the chat template writes ``developer`` messages. OpenAI's newer clients send
        their instructions as ``developer`` where older ones sent ``system``; a template that knows
        only ``system`` (Qwen's, Llama's) skips a role it does not know, without a word."""
        template = getattr(self.tokenizer, "chat_template", None)
        sources = template.values() if isinstance(template, dict) else [template]
        return any(isinstance(t, str) and "developer" in t for t in sources)

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
        """``(text, start, end)`` per chunk of about ``chunk_tokens`` tokens (a chunk that ends
        inside a character joins the next); texts add up to ``decode(ids)``."""
        decoder = IncrementalDecoder(self)
        n = len(ids)
        start = end = 0
        while end < n:
            step_end = min(n, end + chunk_tokens)
            text = decoder.push(ids[end:step_end])
            end = step_end
            if end == n:
                text += decoder.finish()
            elif not text:
                continue  # mid-character: the next chunk carries these tokens' text
            yield text, start, end
            start = end


class IncrementalDecoder:
    """The text of a growing list of token ids, handed out as new suffixes.

    Decoding every id again at each step would cost O(n) per step and O(n^2) per stream. As vLLM's
    and TGI's detokenizers do, each step decodes a window instead: the ids already sent since the
    last piece's start (``prefix..read``) and those plus the new ones (``prefix..``); the new text
    is the difference. The window starts a piece back so that a token whose text depends on its
    left neighbour (SentencePiece's leading space) is decoded in context. Text ending in U+FFFD
    (a multi-byte character whose remaining bytes are still to come) waits for the next tokens,
    but only as long as they could complete it: bytes that will never make a character (a model
    repeating a lone byte token, as untrained ones do) would otherwise hold the whole stream back.
    :meth:`finish` decodes all the ids once and sends whatever the windows have not, so the pieces
    add up to ``decode(ids)`` (for tokenizers whose text of a window is the matching slice of the
    whole text: byte-level BPE and SentencePiece, the ones LLMs ship with).
    """

    def __init__(self, codec: TextCodec) -> None:
        self._decode = codec.decode
        self.ids: list[int] = []
        self._prefix = 0  # where the window starts
        self._read = 0  # ids before this are in the text sent
        self._sent: list[str] = []

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the text they complete ("" while a character is incomplete)."""
        self.ids.extend(ids)
        if len(self.ids) == self._read:
            return ""
        before = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self._decode(self.ids[self._prefix :])
        if after.endswith(_REPLACEMENT):
            return self._settled(before, after)
        if len(after) <= len(before) or not after.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return self._emit(after[len(before) :])

    def _settled(self, before: str, after: str) -> str:
        """The text of the ids that no later token can change, while the last ones wait.

        A UTF-8 character is at most 4 bytes and a token that writes anything writes at least one,
        so whatever starts before the last three writing tokens is complete or broken for good by
        now; it is sent if the window up to there decodes to a prefix of the text so far.
        """
        ids, cut, writing = self.ids, len(self.ids), 0
        while cut > self._read and writing < _OPEN_TOKENS:
            cut -= 1
            writing += bool(self._decode(ids[cut : cut + 1]))
        if writing < _OPEN_TOKENS or cut <= self._read:
            return ""
        settled = self._decode(ids[self._prefix : cut])
        if len(settled) <= len(before) or not settled.startswith(before) or not after.startswith(settled):
            return ""
        self._prefix, self._read = self._read, cut
        return self._emit(settled[len(before) :])

    def finish(self) -> str:
        """The text not sent yet, from one decode of all the ids (ends the stream)."""
        full = self._decode(self.ids)
        sent = "".join(self._sent)
        self._prefix = self._read = len(self.ids)
        return self._emit(full[len(sent) :])

    def _emit(self, text: str) -> str:
        if text:
            self._sent.append(text)
        return text


__all__ = ["TextCodec", "IncrementalDecoder"]
