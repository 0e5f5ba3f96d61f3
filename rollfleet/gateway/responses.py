"""Response bodies: OpenAI's shapes (plus the token extension), whole or as SSE chunks. No I/O.

A streamed request with one prompt and one choice is sent as the fleet samples it
(:mod:`rollfleet.gateway.live`). The chunk builders here replay a finished generation instead,
for what cannot go live: several prompts or choices (``n`` > 1) in one stream, and chat replies
whose tool calls are parsed from the whole text. A replayed stream keeps that a bad request still
gets its 4xx status and that the streamed text and token ids are exactly the non-streamed answer's.

The token extension (``return_token_ids``, and ``/v1/completions/tokens``) adds to each choice:
``token_ids``, ``token_logprobs``, ``weight_versions`` (per token, when known),
``min_weight_version`` / ``max_weight_version`` (of the first and last token), ``num_resumes``,
``num_preempted`` and ``replica_id``.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Iterator, Optional, Sequence

from rollfleet.gateway.codec import TextCodec
from rollfleet.gateway.jsonio import dumps
from rollfleet.types import TokenOutput

#: rollfleet's stop reasons -> OpenAI finish reasons ("abort" as vLLM says: resumes ran out).
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}

SSE_DONE = b"data: [DONE]\n\n"

#: A chat choice's assistant message and whether it calls tools.
Reply = tuple[dict[str, Any], bool]


#: Response ids: a random per-process prefix and a counter (unique, and no urandom call per request).
_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ID_PREFIX}{next(_ID_COUNTER):x}"


def finish_reason(out: TokenOutput) -> str:
    return FINISH_REASONS.get(out.stop_reason, out.stop_reason)


def chat_finish_reason(out: TokenOutput, calls: bool) -> str:
    """``tool_calls`` when a reply that ended by itself calls tools (OpenAI's reason)."""
    return "tool_calls" if calls and out.stop_reason == "stop" else finish_reason(out)


def usage(prompt_tokens: int, outputs: Sequence[TokenOutput]) -> dict[str, int]:
    """OpenAI's usage: every prompt counted once however many choices it has (as OpenAI and vLLM
    count), every choice's completion tokens."""
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def token_fields(out: TokenOutput) -> dict[str, Any]:
    """Everything an RL trainer needs about one choice, without a tokenizer round trip."""
    extra = out.extra_fields
    return {
        "token_ids": out.token_ids,
        "token_logprobs": out.log_probs,
        "weight_versions": out.token_versions,
        "min_weight_version": extra.get("min_global_steps"),
        "max_weight_version": extra.get("max_global_steps"),
        "num_resumes": extra.get("num_resumes", 0),
        "num_preempted": out.num_preempted,
        "replica_id": extra.get("replica_id"),
    }


def meta_fields(out: TokenOutput) -> dict[str, Any]:
    """The token extension without the per-token lists (they went out chunk by chunk)."""
    fields = token_fields(out)
    for key in ("token_ids", "token_logprobs", "weight_versions"):
        fields.pop(key)
    return fields


def completion_logprobs(
    codec: TextCodec, out: TokenOutput, start: int = 0, end: Optional[int] = None, offset: int = 0
) -> Optional[dict[str, Any]]:
    """OpenAI's legacy logprobs object (the sampled token's logprob; no alternatives)."""
    if out.log_probs is None:
        return None
    ids = out.token_ids[start:end]
    texts = codec.token_texts(ids)
    offsets = []
    pos = offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": out.log_probs[start:end], "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(
    codec: TextCodec, out: TokenOutput, start: int = 0, end: Optional[int] = None
) -> Optional[dict[str, Any]]:
    """OpenAI's chat logprobs object (the sampled token's logprob; ``top_logprobs`` empty)."""
    if out.log_probs is None:
        return None
    texts = codec.token_texts(out.token_ids[start:end])
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(texts, out.log_probs[start:end])
        ]
    }


# ---------------------------------------------------------------------- whole bodies
def completion_body(
    model: str,
    codec: TextCodec,
    outputs: Sequence[TokenOutput],
    prompts: Sequence[list[int]],
    n: int,
    *,
    logprobs: bool,
    return_token_ids: bool,
    echo_texts: Optional[Sequence[str]] = None,
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        prefix = echo_texts[i // n] if echo_texts else ""
        choice: dict[str, Any] = {
            "index": i,
            "text": prefix + codec.decode(out.token_ids),
            "logprobs": completion_logprobs(codec, out, offset=len(prefix)) if logprobs else None,
            "finish_reason": finish_reason(out),
        }
        if return_token_ids:
            choice["prompt_token_ids"] = prompts[i // n]
            choice.update(token_fields(out))
        choices.append(choice)
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(sum(len(p) for p in prompts), outputs),
    }


def chat_body(
    model: str,
    codec: TextCodec,
    outputs: Sequence[TokenOutput],
    prompt_ids: list[int],
    *,
    logprobs: bool,
    return_token_ids: bool,
    replies: Optional[Sequence[Reply]] = None,
) -> dict[str, Any]:
    """``replies``: each choice's assistant message and whether it calls tools (plain text if None)."""
    choices = []
    for i, out in enumerate(outputs):
        message, calls = (
            replies[i] if replies else ({"role": "assistant", "content": codec.decode(out.token_ids)}, False)
        )
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(codec, out) if logprobs else None,
            "finish_reason": chat_finish_reason(out, calls),
        }
        if return_token_ids:
            choice.update(token_fields(out))
        choices.append(choice)
    body: dict[str, Any] = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), outputs),
    }
    if return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def tokens_body(model: str, outputs: Sequence[TokenOutput], prompt_len: int) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice = {"index": i, "finish_reason": finish_reason(out)}
        choice.update(token_fields(out))
        choices.append(choice)
    return {
        "id": new_id("tok"),
        "object": "rollfleet.completion.tokens",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_len, outputs),
    }


# ---------------------------------------------------------------------- SSE
def sse(events: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """``data: {json}`` per event, then ``data: [DONE]``."""
    for event in events:
        yield b"data: " + dumps(event) + b"\n\n"
    yield SSE_DONE


def completion_chunks(
    model: str,
    codec: TextCodec,
    outputs: Sequence[TokenOutput],
    prompts: Sequence[list[int]],
    n: int,
    *,
    chunk_tokens: int,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    echo_texts: Optional[Sequence[str]] = None,
) -> Iterator[dict[str, Any]]:
    base = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model}
    if include_usage:
        base["usage"] = None
    for i, out in enumerate(outputs):
        prefix = echo_texts[i // n] if echo_texts else ""
        offset = len(prefix)
        if prefix or return_token_ids:
            first: dict[str, Any] = {"index": i, "text": prefix, "logprobs": None, "finish_reason": None}
            if return_token_ids:
                first["prompt_token_ids"] = prompts[i // n]
            yield {**base, "choices": [first]}
        for text, start, end in codec.pieces(out.token_ids, chunk_tokens):
            lp = completion_logprobs(codec, out, start, end, offset) if logprobs else None
            choice: dict[str, Any] = {"index": i, "text": text, "logprobs": lp, "finish_reason": None}
            # offsets count each token's own text, as the whole answer's do (a piece's text is
            # not their sum where a token is part of a character, or reads with its neighbour)
            offset += sum(len(t) for t in lp["tokens"]) if lp is not None else len(text)
            if return_token_ids:
                choice["token_ids"] = out.token_ids[start:end]
            yield {**base, "choices": [choice]}
        last: dict[str, Any] = {"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason(out)}
        if return_token_ids:
            last.update(meta_fields(out))
        yield {**base, "choices": [last]}
    if include_usage:
        yield {**base, "choices": [], "usage": usage(sum(len(p) for p in prompts), outputs)}


def chat_chunks(
    model: str,
    codec: TextCodec,
    outputs: Sequence[TokenOutput],
    prompt_ids: list[int],
    *,
    chunk_tokens: int,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    replies: Optional[Sequence[Reply]] = None,
) -> Iterator[dict[str, Any]]:
    base = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    if include_usage:
        base["usage"] = None
    for i, out in enumerate(outputs):
        first: dict[str, Any] = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        event = {**base, "choices": [first]}
        if return_token_ids and i == 0:
            event["prompt_token_ids"] = prompt_ids
        yield event
        message, calls = replies[i] if replies else (None, False)
        if message is not None and calls:  # the calls in one delta, after the text around them
            delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
            if message.get("content"):
                delta["content"] = message["content"]
            yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
        # with calls, the pieces carry their token ids and logprobs only (the text went in the
        # calls' delta): without them a stream that called tools held none of either
        carries = not calls or logprobs or return_token_ids
        for text, start, end in codec.pieces(out.token_ids, chunk_tokens) if carries else ():
            choice: dict[str, Any] = {
                "index": i,
                "delta": {} if calls else {"content": text},
                "logprobs": chat_logprobs(codec, out, start, end) if logprobs else None,
                "finish_reason": None,
            }
            if return_token_ids:
                choice["token_ids"] = out.token_ids[start:end]
            yield {**base, "choices": [choice]}
        last: dict[str, Any] = {
            "index": i,
            "delta": {},
            "logprobs": None,
            "finish_reason": chat_finish_reason(out, calls),
        }
        if return_token_ids:
            last.update(meta_fields(out))
        yield {**base, "choices": [last]}
    if include_usage:
        yield {**base, "choices": [], "usage": usage(len(prompt_ids), outputs)}


__all__ = [
    "FINISH_REASONS",
    "new_id",
    "finish_reason",
    "chat_finish_reason",
    "Reply",
    "usage",
    "token_fields",
    "meta_fields",
    "completion_body",
    "chat_body",
    "tokens_body",
    "sse",
    "completion_chunks",
    "chat_chunks",
]
