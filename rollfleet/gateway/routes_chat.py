"""``/v1/chat/completions``: the chat template, OpenAI function calling, and, for a session,
the trajectory record and a prompt built from the last turn's ids (no retokenisation drift)."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from starlette.requests import Request
from starlette.responses import Response

from rollfleet.gateway import responses
from rollfleet.gateway.continuation import Plan, plan_prompt
from rollfleet.gateway.errors import GatewayError, bad_request
from rollfleet.gateway.protocol import ChatCompletionRequest, ChatMessage
from rollfleet.gateway.routes_base import RoutesBase, json_response, sse_response
from rollfleet.gateway.sampling import field_mapper, sampling_params
from rollfleet.gateway.toolcalls import check_tools
from rollfleet.gateway.trajectories import Sampled, Session, Turn
from rollfleet.types import TokenOutput


class ChatRoutes(RoutesBase):
    async def chat(self, request: Request) -> Response:
        req = await self._parse(ChatCompletionRequest, request)
        self._check(req)
        if req.top_logprobs:  # alternatives the fleet does not return: refused, not answered with none
            raise bad_request(
                "top_logprobs", f"top_logprobs={req.top_logprobs} asks for the most likely alternatives, which the "
                "fleet does not return; logprobs: true gives each sampled token's logprob", code="unsupported_value",
            )  # fmt: skip
        self.limits.check_template_kwargs(req.chat_template_kwargs)
        check_tools(req.tools, req.tool_choice)
        codec = self.codec
        messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
        if not codec.knows_developer_role:  # as the system prompt it replaces (OpenAI's own reading)
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        # Every string the template may render counts (tool calls, extra fields, the tools' JSON
        # schemas), not only the contents: none of it may reach the tokenizer past the limits.
        # chat_template_kwargs too: a template may render any of them (documents, date_string).
        contents: list[str] = []
        rendered = (("messages", messages), ("tools", req.tools), ("chat_template_kwargs", req.chat_template_kwargs))
        for field, value in rendered:
            if value:
                contents += _strings(value, field)
                self.limits.check_prompt_text(contents, field)
                self._check_fits(contents, field)
        session = self._session(request, req)
        store = self.trajectories if session is not None else None
        # the session as it was when this turn was planned: the turn is recorded into it alone
        current = store.get(session) if store is not None and session is not None else None
        plan = await self._plan(req, messages, store is not None, current)
        prompt = plan.prompt_ids
        requested: Optional[int]
        if req.max_completion_tokens is not None:
            requested, budget_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, budget_param = req.max_tokens, "max_tokens"
        budget = self._budget(requested, len(prompt), "messages", budget_param)
        params = sampling_params(req, budget, codec)
        fields = field_mapper("messages", budget_param)
        parse = bool(req.tools) and req.tool_choice != "none"

        def replied(
            outputs: Sequence[TokenOutput], shown: Sequence[Optional[responses.Reply]] = ()
        ) -> list[responses.Reply]:
            """The assistant messages of ``outputs`` (``shown``: those a stream already sent); a
            session's turn is recorded with them."""
            replies = [
                (shown[i] if i < len(shown) else None)
                or self.tool_calls.message(codec.decode(o.token_ids), parse=parse)
                for i, o in enumerate(outputs)
            ]
            if store is not None and session is not None:
                turn = _turn(prompt, outputs, replies, plan)
                store.record(
                    session,
                    messages,
                    req.tools,
                    turn,
                    new_branch=plan.new_branch,
                    chosen=plan.chosen,
                    base=plan.base,
                    template_kwargs=req.chat_template_kwargs,
                    planned_on=current,
                )
            return replies

        gates = self.tool_calls.stream if parse else None
        if req.stream and (gates is None or self.tool_calls.parser.call_start):  # live, calls parsed at the end
            route = "/v1/chat/completions"
            return await self._live(request, "chat", route, req, prompt, params, session, fields, logprobs=req.logprobs,
                                    tools=gates, on_done=replied)  # fmt: skip
        outputs = await self._generate(request, "/v1/chat/completions", [prompt], params, req.n, session, fields)
        replies = replied(outputs)
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
                replies=replies,
            )
            return sse_response(events, headers)
        body = responses.chat_body(
            req.model,
            self.codec,
            outputs,
            prompt,
            logprobs=req.logprobs,
            return_token_ids=req.return_token_ids,
            replies=replies,
        )
        return json_response(body, headers=headers)

    async def _plan(
        self,
        req: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        in_session: bool,
        current: Optional[Session],
    ) -> Plan:
        """The turn's prompt ids: from the session's last turn (``current``: the session, None
        before its first turn) when it extends it, else rendered."""
        if in_session and req.add_generation_prompt and not req.continue_final_message:
            return await self.limits.offload(
                plan_prompt,
                self.codec,
                current.snapshot() if current is not None else None,
                messages,
                tools=req.tools,
                template_kwargs=req.chat_template_kwargs,
            )
        ids = await self.limits.offload(
            self.codec.render_chat,
            messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
        )
        why = "rendered without a generation prompt (continue_final_message)"
        return Plan(ids, new_branch=why, base=current.last_turn if current is not None else None)


def _turn(prompt: list[int], outputs: Sequence[TokenOutput], replies: Sequence[responses.Reply], plan: Plan) -> Turn:
    choices = [
        Sampled(
            token_ids=list(o.token_ids),
            logprobs=list(o.log_probs) if o.log_probs is not None else [None] * len(o.token_ids),
            versions=list(o.token_versions or [None] * len(o.token_ids)),
            finish_reason=responses.chat_finish_reason(o, calls),
            message=message,
        )
        for o, (message, calls) in zip(outputs, replies)
    ]
    return Turn(list(prompt), choices, reused=plan.reused)


#: How deep the JSON a chat template renders may nest (tool-call arguments, tools' schemas):
#: deeper, the template's own recursion would fail the request with a 500.
MAX_JSON_DEPTH = 64


def _strings(value: Any, field: str) -> list[str]:
    """Every string in a JSON-like value (dict values, list items), for the prompt-size limits;
    a value nested deeper than :data:`MAX_JSON_DEPTH` is refused, naming ``field``."""
    out: list[str] = []
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, (dict, list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                raise bad_request(field, f"is nested deeper than {MAX_JSON_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in reversed(list(children)))
            if isinstance(item, dict):  # keys are rendered too (a schema's property names): counted
                out.extend(k for k in item if isinstance(k, str))
    return out


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: text content as one string, and a tool call's
    arguments as a JSON object (OpenAI sends them as a string; templates write them with tojson)."""
    data = message.model_dump(exclude_none=True)
    for j, call in enumerate(data.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        args = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(function, dict) and isinstance(args, str):
            try:
                function["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise bad_request(
                    f"messages[{index}].tool_calls[{j}].function.arguments", f"is not valid JSON: {exc.msg}"
                ) from None
            except RecursionError:
                raise bad_request(
                    f"messages[{index}].tool_calls[{j}].function.arguments", "is nested too deep to parse"
                ) from None

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


__all__ = ["ChatRoutes"]
