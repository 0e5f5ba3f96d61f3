"""Server-sent events as the fleet samples: one chunk per batch of tokens that reaches the gateway.

Used for a streamed request with one prompt and one choice (``n`` = 1): the client's
:meth:`~rollfleet.client.LLMServerClient.generate_stream` yields token deltas as the replica
forwards them, and each becomes an OpenAI chunk at once, so the first token reaches the caller
after one prefill instead of after the whole generation. A generation cut short by a replica
failure or a weight update goes on elsewhere inside the client; the caller sees one stream.

The stream's first item is awaited before the response starts: a request the fleet refuses still
gets its 4xx status and error body. An error after that arrives as an ``error`` event followed by
``[DONE]`` (the status line has gone). Text comes from the codec's
:class:`~rollfleet.gateway.codec.IncrementalDecoder` (a window of ids per chunk, a character
split across chunks waits for its last byte; the chunks add up to the decoded output).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Optional, Union

from rollfleet.gateway import responses
from rollfleet.gateway.codec import IncrementalDecoder, TextCodec
from rollfleet.gateway.errors import from_exception
from rollfleet.gateway.jsonio import dumps
from rollfleet.gateway.toolcalls import ToolCallStream
from rollfleet.types import TokenDelta, TokenOutput

Stream = AsyncIterator[Union[TokenDelta, TokenOutput]]


async def live_events(
    kind: str,
    model: str,
    codec: TextCodec,
    first: Union[TokenDelta, TokenOutput],
    stream: Stream,
    prompt: list[int],
    *,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    tools: Optional[ToolCallStream] = None,
    on_done: Optional[Callable[[TokenOutput, Optional[responses.Reply]], Any]] = None,
) -> AsyncIterator[bytes]:
    """SSE bytes for a ``chat`` or ``completion`` stream whose first item is already in hand;
    ``tools``: the reply may call tools (its text shows up to the first call, the calls at the end).
    ``on_done`` gets the output, and the chat reply as the caller was shown it (with ``tools``)."""
    chat = kind == "chat"
    base: dict[str, Any] = {
        "id": responses.new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    if include_usage:
        base["usage"] = None
    text = IncrementalDecoder(codec)
    sampled: list[int] = []
    sampled_logprobs: list[float] = []

    def chunk(choice: dict[str, Any]) -> bytes:
        return (
            b"data: "
            + dumps({**base, "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}]})
            + b"\n\n"
        )

    def delta_chunk(delta: TokenDelta) -> Optional[bytes]:
        start = len(sampled)
        sampled.extend(delta.token_ids)
        sampled_logprobs.extend(delta.log_probs)
        piece = text.push(delta.token_ids)
        if tools is not None:
            piece = tools.push(piece)
        if not piece and not return_token_ids and not logprobs:
            return None
        choice: dict[str, Any] = {"delta": {"content": piece}} if chat else {"text": piece}
        if logprobs:
            so_far = TokenOutput.model_construct(token_ids=sampled, log_probs=sampled_logprobs)
            choice["logprobs"] = (
                responses.chat_logprobs(codec, so_far, start)
                if chat
                else responses.completion_logprobs(codec, so_far, start, offset=text.sent_chars - len(piece))
            )
        if return_token_ids:
            choice["token_ids"] = delta.token_ids
        return chunk(choice)

    opening: dict[str, Any] = {"delta": {"role": "assistant", "content": ""}} if chat else {"text": ""}
    if return_token_ids:
        opening["prompt_token_ids"] = prompt
    item: Union[TokenDelta, TokenOutput] = first
    try:  # however the stream ends (the caller hung up too), the fleet's generation is closed
        yield chunk(opening)
        try:
            while isinstance(item, TokenDelta):
                data = delta_chunk(item)
                if data is not None:
                    yield data
                item = await stream.__anext__()
        except Exception as exc:  # the status line has gone: say it in the stream, then end it
            yield b"data: " + dumps(from_exception(exc).body()) + b"\n\n" + responses.SSE_DONE
            return
        out = item
        rest = text.finish()
        reply: Optional[responses.Reply] = None
        if tools is not None:
            shown = tools.push(rest)
            held, message, calls = tools.finish()
            rest, reply = shown + held, (message, calls)
        last: dict[str, Any] = {"delta": {"content": rest} if rest else {}} if chat else {"text": rest}
        if reply is not None and reply[1]:  # the calls, parsed, in one delta
            yield chunk({"delta": {"tool_calls": [{"index": k, **c} for k, c in enumerate(reply[0]["tool_calls"])]}})
        last["finish_reason"] = responses.chat_finish_reason(out, reply[1]) if reply else responses.finish_reason(out)
        if return_token_ids:
            last.update(responses.meta_fields(out))
        yield chunk(last)
        if include_usage:
            yield b"data: " + dumps({**base, "choices": [], "usage": responses.usage(len(prompt), [out])}) + b"\n\n"
        yield responses.SSE_DONE
        if on_done is not None:
            on_done(out, reply)
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["live_events", "Stream"]
