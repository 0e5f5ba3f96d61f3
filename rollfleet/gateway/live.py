"""Server-sent events as the fleet samples: one chunk per batch of tokens that reaches the gateway.

Used for a streamed request with one prompt: the client's
:meth:`~rollfleet.client.LLMServerClient.generate_stream` yields token deltas as the replica
forwards them, and each becomes an OpenAI chunk at once, so the first token reaches the caller
after one prefill instead of after the whole generation. With ``n`` > 1, each choice is its own
stream, and the chunks of all of them go out as they come, each with its choice's index. A
generation cut short by a replica failure or a weight update goes on elsewhere inside the client;
the caller sees one stream.

The stream's first item is awaited before the response starts: a request the fleet refuses still
gets its 4xx status and error body. An error after that arrives as an ``error`` event followed by
``[DONE]`` (the status line has gone). Text comes from the codec's
:class:`~rollfleet.gateway.codec.IncrementalDecoder` (a window of ids per chunk, a character
split across chunks waits for its last byte; the chunks add up to the decoded output).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional, Sequence, Union

from rollfleet.gateway import responses
from rollfleet.gateway.codec import IncrementalDecoder, TextCodec
from rollfleet.gateway.errors import from_exception
from rollfleet.gateway.jsonio import dumps
from rollfleet.gateway.toolcalls import ToolCallStream
from rollfleet.types import TokenDelta, TokenOutput

Stream = AsyncIterator[Union[TokenDelta, TokenOutput]]
Item = Union[TokenDelta, TokenOutput]
_END = object()


class _Choice:
    """One choice of a live stream: its text so far, what it sampled, its tool-call gate."""

    def __init__(self, index: int, codec: TextCodec, tools: Optional[ToolCallStream]) -> None:
        self.index, self.codec, self.tools = index, codec, tools
        self.text = IncrementalDecoder(codec)
        self.sampled: list[int] = []
        self.logprobs: list[float] = []
        self.text_offset = 0  # of the next token (a completion's logprobs.text_offset)
        self.reply: Optional[responses.Reply] = None

    def delta(self, delta: TokenDelta, chat: bool, logprobs: bool, token_ids: bool) -> Optional[dict[str, Any]]:
        """The chunk choice for newly sampled tokens (None: nothing to show yet)."""
        start = len(self.sampled)
        self.sampled.extend(delta.token_ids)
        self.logprobs.extend(delta.log_probs)
        piece = self.text.push(delta.token_ids)
        if self.tools is not None:
            piece = self.tools.push(piece)
        if not piece and not token_ids and not logprobs:
            return None
        choice: dict[str, Any] = {"delta": {"content": piece}} if chat else {"text": piece}
        if logprobs:
            so_far = TokenOutput.model_construct(token_ids=self.sampled, log_probs=self.logprobs)
            if chat:
                choice["logprobs"] = responses.chat_logprobs(self.codec, so_far, start)
            else:
                # Offsets count every token's own text, as a whole answer's do: a token whose text
                # was held back (part of a character) has its offset where it was sampled.
                found = responses.completion_logprobs(self.codec, so_far, start, offset=self.text_offset)
                assert found is not None
                self.text_offset += sum(len(t) for t in found["tokens"])
                choice["logprobs"] = found
        if token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

    def ending(self, out: TokenOutput, chat: bool, token_ids: bool) -> list[dict[str, Any]]:
        """The chunk choices that end it: the text held back, the calls (parsed), the reason."""
        rest = self.text.finish()
        if self.tools is not None:
            shown = self.tools.push(rest)
            held, message, calling = self.tools.finish()
            rest, self.reply = shown + held, (message, calling)
        last: dict[str, Any] = {"delta": {"content": rest} if rest else {}} if chat else {"text": rest}
        out_chunks = []
        if self.reply is not None and self.reply[1]:  # the calls, parsed, in one delta
            calls = [{"index": k, **c} for k, c in enumerate(self.reply[0]["tool_calls"])]
            out_chunks.append({"delta": {"tool_calls": calls}})
        reason = responses.chat_finish_reason(out, self.reply[1]) if self.reply else responses.finish_reason(out)
        last["finish_reason"] = reason
        if token_ids:
            last.update(responses.meta_fields(out))
        return [*out_chunks, last]


async def _merged(firsts: Sequence[Item], streams: Sequence[Stream]) -> AsyncGenerator[tuple[int, Item], None]:
    """``(choice index, item)`` as each stream yields them, until every one has its output."""
    if len(streams) == 1:  # the common case: no task, no queue
        item = firsts[0]
        while True:
            yield 0, item
            if isinstance(item, TokenOutput):
                return
            item = await streams[0].__anext__()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait((i, exc))
        queue.put_nowait((i, _END))

    for i, first in enumerate(firsts):
        yield i, first
    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams) if not isinstance(firsts[i], TokenOutput)]
    try:
        running = len(pumps)
        while running:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                running -= 1
            else:
                yield i, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def live_events(
    kind: str,
    model: str,
    codec: TextCodec,
    firsts: Sequence[Item],
    streams: Sequence[Stream],
    prompt: list[int],
    *,
    logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    tools: Optional[Callable[[], Optional[ToolCallStream]]] = None,
    on_done: Optional[Callable[[list[TokenOutput], list[Optional[responses.Reply]]], Any]] = None,
) -> AsyncIterator[bytes]:
    """SSE bytes for the ``n`` choices (one stream each, whose first items are in hand) of a
    ``chat`` or ``completion`` request, each chunk sent as its choice samples. ``tools`` makes the
    gate of a reply that may call tools; ``on_done`` gets the outputs and the chat replies as the
    caller was shown them."""
    chat = kind == "chat"
    base: dict[str, Any] = {
        "id": responses.new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    if include_usage:
        base["usage"] = None
    choices = [_Choice(i, codec, tools() if tools is not None else None) for i in range(len(streams))]
    outs: list[Optional[TokenOutput]] = [None] * len(streams)

    def chunk(index: int, choice: dict[str, Any], **top: Any) -> bytes:
        body = {**base, "choices": [{"index": index, "logprobs": None, "finish_reason": None, **choice}], **top}
        return b"data: " + dumps(body) + b"\n\n"

    merged = _merged(firsts, streams)
    try:  # however the stream ends (the caller hung up too), the fleet's generations are closed
        for i in range(len(streams)):
            # where the whole answer and the replayed stream put the prompt's ids (as vLLM does):
            # a chat chunk's top level, once; every completion choice's opening
            opening: dict[str, Any] = {"delta": {"role": "assistant", "content": ""}} if chat else {"text": ""}
            top: dict[str, Any] = {}
            if return_token_ids and chat and i == 0:
                top["prompt_token_ids"] = prompt
            elif return_token_ids and not chat:
                opening["prompt_token_ids"] = prompt
            yield chunk(i, opening, **top)
        try:
            async for i, item in merged:
                if isinstance(item, TokenDelta):
                    data = choices[i].delta(item, chat, logprobs, return_token_ids)
                    if data is not None:
                        yield chunk(i, data)
                    continue
                outs[i] = item
                for data in choices[i].ending(item, chat, return_token_ids):
                    yield chunk(i, data)
        except Exception as exc:  # the status line has gone: say it in the stream, then end it
            yield b"data: " + dumps(from_exception(exc).body()) + b"\n\n" + responses.SSE_DONE
            return
        done = [o for o in outs if o is not None]
        if on_done is not None:  # before [DONE]: a caller that hangs up on it, or sends its next
            on_done(done, [c.reply for c in choices])  # turn at once, still finds this one recorded
        if include_usage:
            usage = responses.usage(len(prompt), done)
            yield b"data: " + dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
        yield responses.SSE_DONE
    finally:
        await merged.aclose()  # first: it stops the tasks that read the streams, which then close
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


__all__ = ["live_events", "Stream"]
