"""The OpenAI-compatible route table, and the handlers other than chat: ``/v1/models``,
``/v1/completions``, the token route ``/v1/completions/tokens``, ``/health``, ``/metrics``. The
generation routes and ``/v1/models`` are also served under ``/sessions/{id}/v1/...``: an agent given
that base URL is in session ``id`` without setting a header.

Each handler reads the raw body and validates it with ``model_validate_json`` (pydantic-core parses
and validates in one pass) instead of FastAPI's body machinery: the same 400s, a fraction of the
per-request cost. The token route never calls the tokenizer unless it is given stop strings.
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollfleet.gateway import responses
from rollfleet.gateway.errors import bad_request
from rollfleet.gateway.protocol import CompletionRequest, TokenCompletionRequest
from rollfleet.gateway.routes_base import (
    REPLICA_HEADER,
    SESSION_HEADER,
    SESSION_RESPONSE_HEADER,
    ServedModel,
    json_response,
    parse_body,
    sse_response,
)
from rollfleet.gateway.routes_chat import ChatRoutes
from rollfleet.gateway.sampling import field_mapper, sampling_params


class OpenAIRoutes(ChatRoutes):
    """The handlers (chat's come from :class:`ChatRoutes`) and the table that routes to them."""

    def routes(self) -> list[Route]:
        wrap = self.instrument
        generation = [
            ("/v1/completions", self.completions),
            ("/v1/chat/completions", self.chat),
            ("/v1/completions/tokens", self.tokens),
        ]
        return [
            Route("/v1/models", wrap("/v1/models", self.models), methods=["GET"]),
            # an agent handed a session's base URL may list the models first, as against any other
            Route("/sessions/{session_id:path}/v1/models", wrap("/v1/models", self.models), methods=["GET"]),
            *(Route(path, wrap(path, handler), methods=["POST"]) for path, handler in generation),
            *(
                Route("/sessions/{session_id:path}" + path, wrap(path, handler), methods=["POST"])
                for path, handler in generation
            ),
            Route("/health", wrap("/health", self.health), methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

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
        params = sampling_params(req, budget, self.codec if req.stop else None, vocab_size=self.codec.vocab_size)
        session = self._session(request, req)
        fields = field_mapper("prompt_token_ids", "max_tokens", keep_prompt_index=True)
        outputs = await self._generate(request, "/v1/completions/tokens", [prompt], params, req.n, session, fields)
        return json_response(
            responses.tokens_body(req.model, outputs, len(prompt)), headers=self._headers(outputs, session)
        )

    async def completions(self, request: Request) -> Response:
        req = await self._parse(CompletionRequest, request)
        batch = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        self._check(req, len(batch) if batch and isinstance(batch[0], (str, list)) else 1)  # before tokenizing
        if req.suffix:
            raise bad_request("suffix", "suffix (insertion) is not supported", code="unsupported_value")
        if req.echo and req.logprobs is not None:  # scorers read the prompt's logprobs from these
            raise bad_request(
                "logprobs", "echo with logprobs needs the prompt's logprobs, which the fleet does not compute",
                code="unsupported_value",
            )  # fmt: skip
        if req.logprobs:  # alternatives the fleet does not return: refused, not answered with none
            raise bad_request(
                "logprobs", f"logprobs={req.logprobs} asks for the most likely alternatives, which the fleet does "
                "not return; logprobs=0 gives each sampled token's logprob", code="unsupported_value",
            )  # fmt: skip
        codec = self.codec
        prompts, texts = await self._completion_prompts(req.prompt)
        budget = max_len = 0
        for prompt in prompts:  # one budget for the batch: the tightest prompt decides
            b = self._budget(req.max_tokens, len(prompt), "prompt", "max_tokens")
            if not max_len or len(prompt) > max_len:
                budget, max_len = b, len(prompt)
        params = sampling_params(req, budget, codec)
        session = self._session(request, req)
        if req.stream and len(prompts) == 1 and not req.echo:
            route, fields = "/v1/completions", field_mapper("prompt")
            logprobs_on = req.logprobs is not None
            return await self._live(
                request, "completion", route, req, prompts[0], params, session, fields, logprobs=logprobs_on
            )
        outputs = await self._generate(
            request, "/v1/completions", prompts, params, req.n, session, field_mapper("prompt")
        )
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

    async def health(self, request: Request) -> Response:
        status = self.service.client.get_status()
        healthy = status["active_servers"] > 0
        body = {"status": "ok" if healthy else "no_replica_available", "routable_replicas": status["active_servers"]}
        return json_response(body, status=200 if healthy else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


__all__ = [
    "OpenAIRoutes",
    "ServedModel",
    "SESSION_HEADER",
    "REPLICA_HEADER",
    "SESSION_RESPONSE_HEADER",
    "parse_body",
    "json_response",
]
