"""What the OpenAI-compatible handlers share: body parsing, responses, and the per-request
helpers (model and limit checks, the session a request belongs to, budgets, headers).

The handlers themselves are in :mod:`rollfleet.gateway.routes_chat` (chat, with tool calls and
trajectory capture) and :mod:`rollfleet.gateway.routes_openai` (everything else, and the route table).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Optional,
    Sequence,
    TypeVar,
    cast,
)

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rollfleet.gateway import responses
from rollfleet.gateway.errors import (
    FieldMap,
    bad_request,
    client_gone,
    from_exception,
    from_validation_error,
    model_not_found,
)
from rollfleet.gateway.jsonio import dumps
from rollfleet.gateway.limits import GatewayLimits
from rollfleet.gateway.live import live_events
from rollfleet.gateway.protocol import _GenerationRequest
from rollfleet.gateway.sampling import choice_params, token_budget
from rollfleet.gateway.sessions import SESSION_KEY_HEADER, SessionKeys
from rollfleet.gateway.toolcalls import ToolCallFormatter, ToolCallStream
from rollfleet.gateway.trajectories import TrajectoryStore
from rollfleet.types import SamplingParams, TokenOutput

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client import CollectorRegistry

    from rollfleet.config import GatewayConfig
    from rollfleet.gateway.codec import TextCodec
    from rollfleet.gateway.service import GenerationService

M = TypeVar("M", bound=BaseModel)

SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "X-Rollfleet-Replica"
SESSION_RESPONSE_HEADER = "X-Rollfleet-Session"


def parse_body(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def until_disconnected(request: Request) -> None:
    """Return once the client has closed the connection. Call it after the body was read: the
    server then answers ``receive`` only when the client goes (vLLM's ``with_cancellation``
    listens the same way)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_response(body: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json", headers=headers)


async def _aiter(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """Serve a sync generator from the event loop (Starlette would hop to a thread per chunk)."""
    for chunk in chunks:
        yield chunk


def sse_response(events: Iterator[dict[str, Any]], headers: dict[str, str]) -> StreamingResponse:
    headers = {**headers, "Cache-Control": "no-cache"}
    return StreamingResponse(_aiter(responses.sse(events)), media_type="text/event-stream", headers=headers)


@dataclass(frozen=True)
class ServedModel:
    """What the routes say about the model they serve."""

    names: tuple[str, ...]
    max_model_len: int
    default_max_tokens: int
    created: int


async def _unless_gone(request: Request, work: "asyncio.Future[Any]") -> bool:
    """Wait for ``work`` unless the caller hangs up first, then cancel it (and wait for that);
    returns whether the caller left. Cancelled from outside too (a shutdown), neither the work
    nor the watch outlives the handler."""
    gone = asyncio.ensure_future(until_disconnected(request))
    left = True
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        left = not work.done()
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    return left


class RoutesBase:
    """State and helpers of the OpenAI-compatible handlers. They get exactly what they use (the
    generation service, the tokenizer, the served model, the gateway's settings, the metrics registry
    and the wrapper that counts requests and shapes errors); only :mod:`rollfleet.gateway.app` knows
    every part."""

    def __init__(
        self,
        service: "GenerationService",
        codec: "TextCodec",
        model: ServedModel,
        config: "GatewayConfig",
        registry: "CollectorRegistry",
        instrument: Callable[[str, Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]],
        limits: Optional[GatewayLimits] = None,
        trajectories: Optional[TrajectoryStore] = None,
        sessions: Optional[SessionKeys] = None,
    ) -> None:
        self.service = service
        self.codec = codec
        self.model = model
        self.config = config
        self.registry = registry
        self.instrument = instrument
        self.limits = limits or GatewayLimits(config)
        self.sessions = sessions or SessionKeys(config.session_secret, config.admin_token)
        self.trajectories = trajectories
        self.tool_calls = ToolCallFormatter(config.tool_call_parser)

    # ------------------------------------------------------------------ helpers
    async def _parse(self, model: type[M], request: Request) -> M:
        return parse_body(model, await self.limits.read_body(request))

    def _check(self, req: _GenerationRequest, prompts: int = 1) -> None:
        if req.model not in self.model.names:
            raise model_not_found(req.model, self.model.names)
        if req.n > self.config.max_n:
            raise bad_request("n", f"n must be <= {self.config.max_n} on this gateway", code="invalid_value")
        self.limits.check_generations(prompts, req.n)

    def _session(self, request: Request, req: _GenerationRequest) -> Optional[str]:
        for param, value in (("session_id", request.path_params.get("session_id")),
                             (SESSION_HEADER, request.headers.get(SESSION_HEADER)), ("session_id", req.session_id),
                             ("user", req.user)):  # fmt: skip
            if value:
                self.limits.check_session_id(value, param)
                if self.trajectories is not None:  # a closed one generates nothing more
                    self.trajectories.check_open(value, param)
                return value
        return None

    async def _generate(
        self,
        request: Request,
        route: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int,
        session_id: Optional[str],
        fields: FieldMap,
    ) -> list[TokenOutput]:
        """The whole answer, unless the caller hangs up first: then the fleet's requests are
        cancelled (aborted in the engines) and nothing after this runs, so a session records no
        turn and issues no key for an answer nobody received (a client's timeout retry would
        otherwise find its session's key taken by the attempt it gave up on)."""
        generation = asyncio.ensure_future(self.service.generate(route, prompts, params, n=n, session_id=session_id))
        if await _unless_gone(request, generation) or generation.cancelled():
            raise client_gone()
        try:
            return generation.result()
        except Exception as exc:
            raise from_exception(exc, fields) from exc

    def _headers(self, outputs: Sequence[TokenOutput], session_id: Optional[str]) -> dict[str, str]:
        headers = {}
        replica = outputs[0].extra_fields.get("replica_id") if outputs else None
        if replica:
            headers[REPLICA_HEADER] = str(replica)
        if session_id:
            key = self.sessions.issue(session_id)  # to the turn that opened it only
            if key is not None:
                headers[SESSION_KEY_HEADER] = key  # what reading, scoring or ending the session takes
            if session_id.isascii() and session_id.isprintable():  # a header must be latin-1
                headers[SESSION_RESPONSE_HEADER] = session_id
        return headers

    async def _live(
        self,
        request: Request,
        kind: str,
        route: str,
        req: _GenerationRequest,
        prompt: list[int],
        params: SamplingParams,
        session: Optional[str],
        fields: FieldMap,
        *,
        logprobs: bool,
        tools: Optional[Callable[[], Optional[ToolCallStream]]] = None,
        on_done: Optional[Callable[[list[TokenOutput], list[Optional[responses.Reply]]], Any]] = None,
    ) -> Response:
        """``req.n`` streamed choices, sent as the fleet samples them (:mod:`rollfleet.gateway.live`).
        A caller that hangs up before the first token (queued behind others) stops them then, and
        gets no session key, as :meth:`_generate`'s caller does."""
        streams = [
            self.service.generate_stream(route, prompt, choice_params(params, i), session_id=session)
            for i in range(req.n)
        ]
        first = asyncio.ensure_future(asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True))
        if await _unless_gone(request, first):
            for stream in streams:
                await cast(AsyncGenerator, stream).aclose()
            raise client_gone()
        firsts = first.result()
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:  # before the status line: the caller gets the proper status
            for stream in streams:
                await cast(AsyncGenerator, stream).aclose()
            if not isinstance(failed, Exception):
                raise failed
            raise from_exception(failed, fields) from failed
        options = req.stream_options
        events = live_events(
            kind,
            req.model,
            self.codec,
            cast(list, firsts),
            streams,
            prompt,
            logprobs=logprobs,
            return_token_ids=req.return_token_ids,
            include_usage=bool(options and options.include_usage),
            tools=tools,
            on_done=on_done,
        )
        headers = {**self._headers([], session), "Cache-Control": "no-cache"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    def _check_fits(self, texts: list[str], param: str) -> None:
        """Prompt text that cannot fit the context even at the longest token per step is refused
        before the tokenizer (or the chat template) runs on it."""
        chars = sum(len(t) for t in texts)
        at_least = self.codec.min_tokens(chars)
        if at_least >= self.model.max_model_len:
            raise bad_request(
                param,
                f"the prompt is {chars} characters, at least {at_least} tokens; this model's context is "
                f"{self.model.max_model_len} tokens",
                code="context_length_exceeded",
            )

    def _budget(self, requested: Optional[int], prompt_len: int, prompt_param: str, budget_param: str) -> int:
        return token_budget(
            requested,
            prompt_len,
            max_model_len=self.model.max_model_len,
            default=self.model.default_max_tokens,
            prompt_param=prompt_param,
            budget_param=budget_param,
        )


__all__ = [
    "RoutesBase",
    "ServedModel",
    "parse_body",
    "json_response",
    "sse_response",
    "SESSION_HEADER",
    "REPLICA_HEADER",
    "SESSION_RESPONSE_HEADER",
]
