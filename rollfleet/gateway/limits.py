"""The gateway's limits on what a caller can make it do: body size and read time, prompt text,
generations per request, session ids, chat templates, and tokenizer work kept off the event loop.

A public endpoint runs work a caller chooses. Each limit here bounds one kind of it, answers with
the OpenAI error shape naming the field and the limit, and is a ``gateway`` config field:

* the body: ``Content-Length`` over ``max_body_bytes`` is refused before a byte is read (413), and
  a body that grows past it while streaming in, or takes longer than ``body_timeout_s``, too (408);
* prompt text over ``max_prompt_chars`` never reaches the tokenizer;
* tokenizing and chat-template rendering run on ``tokenizer_threads`` threads, off the event loop;
  the tokenizer still holds Python's GIL, so text that cannot fit the context is refused from its
  length before it is tokenized (``OpenAIRoutes._check_fits``);
* ``chat_template`` among ``chat_template_kwargs`` is the caller's own Jinja program: refused unless
  the operator sets ``allow_caller_chat_template``;
* prompts x ``n`` over ``max_generations``, and session ids over ``max_session_id_chars``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from starlette.requests import ClientDisconnect, Request

from rollfleet.gateway.errors import GatewayError, bad_request

if TYPE_CHECKING:  # pragma: no cover
    from rollfleet.config import GatewayConfig

T = TypeVar("T")

#: chat_template_kwargs keys that replace the template (caller code) rather than parametrise it.
TEMPLATE_KEYS = frozenset({"chat_template", "template"})
#: Arguments of the template call that the request's own fields or the gateway set; in
#: chat_template_kwargs they would clash with them (a TypeError naming no field).
RENDER_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
)


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, f"the request body is larger than this gateway's limit of {limit} bytes (gateway.max_body_bytes)",
        "invalid_request_error", None, "request_too_large",
    )  # fmt: skip


class GatewayLimits:
    """What one gateway allows; shared by its routes."""

    def __init__(self, config: "GatewayConfig") -> None:
        self.config = config
        self._pool: Optional[ThreadPoolExecutor] = None

    async def read_body(self, request: Request) -> bytes:
        """The request body, within ``max_body_bytes`` and ``body_timeout_s``."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit)

        async def receive() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(receive(), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise GatewayError(
                408, f"the request body did not arrive within {self.config.body_timeout_s:g}s (gateway.body_timeout_s)",
                "invalid_request_error", None, "request_timeout",
            ) from None  # fmt: skip
        except ClientDisconnect:
            raise GatewayError(400, "the client went away while sending the body", code="client_disconnected") from None

    def check_prompt_text(self, texts: list[str], param: str) -> None:
        total = sum(len(t) for t in texts)
        if total > self.config.max_prompt_chars:
            raise bad_request(
                param,
                f"the prompt text is {total} characters; this gateway tokenizes at most "
                f"{self.config.max_prompt_chars} (gateway.max_prompt_chars)",
                code="context_length_exceeded",
            )

    def check_generations(self, prompts: int, n: int) -> None:
        if prompts * n > self.config.max_generations:
            raise bad_request(
                "n" if prompts == 1 else "prompt",
                f"{prompts} prompts x n={n} is {prompts * n} generations; this gateway starts at most "
                f"{self.config.max_generations} per request (gateway.max_generations)",
            )

    def check_session_id(self, session_id: Optional[str], param: str) -> None:
        if session_id is not None and len(session_id) > self.config.max_session_id_chars:
            raise bad_request(
                param,
                f"the session id is {len(session_id)} characters; at most {self.config.max_session_id_chars} "
                "(gateway.max_session_id_chars)",
            )

    def check_template_kwargs(self, kwargs: Optional[dict[str, Any]]) -> None:
        if not kwargs:
            return
        for key in sorted(RENDER_ARGUMENTS.intersection(kwargs)):
            raise bad_request(
                f"chat_template_kwargs.{key}",
                "is set by the request itself (its own field, or the gateway), not by chat_template_kwargs",
            )
        if self.config.allow_caller_chat_template:
            return
        for key in TEMPLATE_KEYS.intersection(kwargs):
            raise bad_request(
                f"chat_template_kwargs.{key}",
                "a caller's own chat template is refused: only the served model's template renders "
                "(the operator may set gateway.allow_caller_chat_template)",
                code="unsupported_value",
            )

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run tokenizer work on the gateway's bounded thread pool, off the event loop."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.tokenizer_threads, thread_name_prefix="rollfleet-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["GatewayLimits", "RENDER_ARGUMENTS", "TEMPLATE_KEYS", "too_large"]
