"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
the token route ``/v1/completions/tokens``, ``DELETE /v1/sessions/{id}``, ``/health``, ``/metrics``.

Each handler reads the raw body and validates it with ``model_validate_json`` (pydantic-core parses
and validates in one pass) instead of FastAPI's body machinery: the same 400s, a fraction of the
per-request cost. The token route never calls the tokenizer unless it is given stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, Sequence, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rollfleet.gateway import responses
from rollfleet.gateway.errors import (
    FieldMap,
    GatewayError,
    bad_request,
    from_exception,
    from_validation_error,
    model_not_found,
)
from rollfleet.gateway.jsonio import dumps
from rollfleet.gateway.limits import GatewayLimits
from rollfleet.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenCompletionRequest,
    _GenerationRequest,
)
from rollfleet.gateway.sampling import field_mapper, sampling_params, token_budget
from rollfleet.gateway.sessions import SESSION_KEY_HEADER, SessionKeys
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


class OpenAIRoutes:
    """The OpenAI-compatible handlers. They get exactly what they use (the generation service,
    the tokenizer, the served model, the gateway's settings, the metrics registry and the wrapper
    that counts requests and shapes errors); only :mod:`rollfleet.gateway.app` knows every part."""

    def __init__(
        self,
        service: "GenerationService",
        codec: "TextCodec",
        model: ServedModel,
        config: "GatewayConfig",
        registry: "CollectorRegistry",
        instrument: Callable[[str, Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]],
        limits: Optional[GatewayLimits] = None,
    ) -> None:
        self.service = service
        self.codec = codec
        self.model = model
        self.config = config
        self.registry = registry
        self.instrument = instrument
        self.limits = limits or GatewayLimits(config)
        self.sessions = SessionKeys(config.session_secret, config.admin_token)

    def routes(self) -> list[Route]:
        wrap = self.instrument
        return [
            Route("/v1/models", wrap("/v1/models", self.models), methods=["GET"]),
            Route("/v1/completions", wrap("/v1/completions", self.completions), methods=["POST"]),
            Route("/v1/chat/completions", wrap("/v1/chat/completions", self.chat), methods=["POST"]),
            Route("/v1/completions/tokens", wrap("/v1/completions/tokens", self.tokens), methods=["POST"]),
            Route("/v1/sessions/{session_id}", wrap("/v1/sessions", self.finish_session), methods=["DELETE"]),
            Route("/health", wrap("/health", self.health), methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

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
        for param, value in ((SESSION_HEADER, request.headers.get(SESSION_HEADER)), ("session_id", req.session_id),
                             ("user", req.user)):  # fmt: skip
            if value:
                self.limits.check_session_id(value, param)
                return value
        return None

    async def _generate(
        self,
        route: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int,
        session_id: Optional[str],
        fields: FieldMap,
    ) -> list[TokenOutput]:
        try:
            return await self.service.generate(route, prompts, params, n=n, session_id=session_id)
        except Exception as exc:
            raise from_exception(exc, fields) from exc

    def _headers(self, outputs: Sequence[TokenOutput], session_id: Optional[str]) -> dict[str, str]:
        headers = {}
        replica = outputs[0].extra_fields.get("replica_id") if outputs else None
        if replica:
            headers[REPLICA_HEADER] = str(replica)
        if session_id:
            headers[SESSION_KEY_HEADER] = self.sessions.key(session_id)  # what ending the session takes
            if session_id.isascii() and session_id.isprintable():  # a header must be latin-1
                headers[SESSION_RESPONSE_HEADER] = session_id
        return headers

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

    # ------------------------------------------------------------------ routes
    async def models(self, request: Request) -> Response:
        model = self.model
        data = [
            {
                "id": name,
                "object": "model",
                "created": model.created,
                "owned_by": "rollfleet",
                "max_model_len": model.max_model_len,
            }
            for name in model.names
        ]
        return json_response({"object": "list", "data": data})

    async def tokens(self, request: Request) -> Response:
        req = await self._parse(TokenCompletionRequest, request)
        self._check(req)
        if req.stream:
            raise bad_request(
                "stream", "the token route does not stream; use /v1/completions with stream", code="unsupported_value"
            )
        prompt = req.prompt_token_ids
        budget = self._budget(req.max_tokens, len(prompt), "prompt_token_ids", "max_tokens")
        params = sampling_params(req, budget, self.codec if req.stop else None)
        session = self._session(request, req)
        fields = field_mapper("prompt_token_ids", "max_tokens", keep_prompt_index=True)
        outputs = await self._generate("/v1/completions/tokens", [prompt], params, req.n, session, fields)
        return json_response(
            responses.tokens_body(req.model, outputs, len(prompt)), headers=self._headers(outputs, session)
        )

    async def completions(self, request: Request) -> Response:
        req = await self._parse(CompletionRequest, request)
        batch = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        self._check(req, len(batch) if batch and isinstance(batch[0], (str, list)) else 1)  # before tokenizing
        if req.suffix:
            raise bad_request("suffix", "suffix (insertion) is not supported", code="unsupported_value")
        codec = self.codec
        prompts, texts = await self._completion_prompts(req.prompt)
        budget = max_len = 0
        for prompt in prompts:  # one budget for the batch: the tightest prompt decides
            b = self._budget(req.max_tokens, len(prompt), "prompt", "max_tokens")
            if not max_len or len(prompt) > max_len:
                budget, max_len = b, len(prompt)
        params = sampling_params(req, budget, codec)
        session = self._session(request, req)
        outputs = await self._generate("/v1/completions", prompts, params, req.n, session, field_mapper("prompt"))
        echo = (texts if texts is not None else [codec.decode(p) for p in prompts]) if req.echo else None
        logprobs = req.logprobs is not None
        headers = self._headers(outputs, session)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = responses.completion_chunks(
                req.model,
                codec,
                outputs,
                prompts,
                req.n,
                chunk_tokens=self.config.stream_chunk_tokens,
                logprobs=logprobs,
                return_token_ids=req.return_token_ids,
                include_usage=include_usage,
                echo_texts=echo,
            )
            return sse_response(events, headers)
        body = responses.completion_body(
            req.model,
            codec,
            outputs,
            prompts,
            req.n,
            logprobs=logprobs,
            return_token_ids=req.return_token_ids,
            echo_texts=echo,
        )
        return json_response(body, headers=headers)

    async def _completion_prompts(self, prompt: Any) -> tuple[list[list[int]], Optional[list[str]]]:
        """Text, a batch of texts, token ids or a batch of token ids -> token-id prompts (text is
        tokenized off the event loop, within the gateway's prompt-text limit)."""
        codec = self.codec
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt", "the prompt is empty")
        if isinstance(prompt[0], str):
            texts: Optional[list[str]] = list(prompt)
            self.limits.check_prompt_text(list(prompt), "prompt")
            for i, text in enumerate(prompt):
                self._check_fits([text], "prompt" if len(prompt) == 1 else f"prompt[{i}]")
            prompts = await self.limits.offload(lambda: [codec.encode(p) for p in prompt])
        elif isinstance(prompt[0], int):
            prompts, texts = [list(prompt)], None
        else:
            prompts, texts = [list(p) for p in prompt], None
        for i, ids in enumerate(prompts):
            if not ids:
                raise bad_request("prompt" if len(prompts) == 1 else f"prompt[{i}]", "the prompt is empty")
        return prompts, texts

    async def chat(self, request: Request) -> Response:
        req = await self._parse(ChatCompletionRequest, request)
        self._check(req)
        self.limits.check_template_kwargs(req.chat_template_kwargs)
        codec = self.codec
        messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
        contents = [str(m.get("content", "")) for m in messages]
        self.limits.check_prompt_text(contents, "messages")
        self._check_fits(contents, "messages")
        prompt = await self.limits.offload(
            codec.render_chat,
            messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
        )
        requested: Optional[int]
        if req.max_completion_tokens is not None:
            requested, budget_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, budget_param = req.max_tokens, "max_tokens"
        budget = self._budget(requested, len(prompt), "messages", budget_param)
        params = sampling_params(req, budget, codec)
        session = self._session(request, req)
        fields = field_mapper("messages", budget_param)
        outputs = await self._generate("/v1/chat/completions", [prompt], params, req.n, session, fields)
        headers = self._headers(outputs, session)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = responses.chat_chunks(
                req.model,
                codec,
                outputs,
                prompt,
                chunk_tokens=self.config.stream_chunk_tokens,
                logprobs=req.logprobs,
                return_token_ids=req.return_token_ids,
                include_usage=include_usage,
            )
            return sse_response(events, headers)
        body = responses.chat_body(
            req.model, codec, outputs, prompt, logprobs=req.logprobs, return_token_ids=req.return_token_ids
        )
        return json_response(body, headers=headers)

    async def finish_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        self.limits.check_session_id(session_id, "session_id")
        self.sessions.check(request, session_id)
        return json_response({"session_id": session_id, "finished": self.service.finish_session(session_id)})

    async def health(self, request: Request) -> Response:
        status = self.service.client.get_status()
        healthy = status["active_servers"] > 0
        body = {"status": "ok" if healthy else "no_replica_available", "routable_replicas": status["active_servers"]}
        return json_response(body, status=200 if healthy else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: text content as one string."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if content is None:
        data["content"] = ""
    elif not isinstance(content, str):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise GatewayError(
                    400,
                    f"content part of type '{part.type}' is not supported by a text model; use 'text' parts",
                    param=f"messages[{index}].content[{j}].type",
                    code="unsupported_value",
                )
            texts.append(part.text)
        data["content"] = "\n".join(texts)
    return data


__all__ = ["OpenAIRoutes", "SESSION_HEADER", "REPLICA_HEADER", "SESSION_RESPONSE_HEADER", "parse_body", "json_response"]
