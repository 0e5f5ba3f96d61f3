"""``tool_agent``: multi-turn tool calling over the tokenizer's chat template (verl's ``ToolAgentLoop``).

One trajectory = GENERATE -> (tool calls? run them, append results) -> GENERATE -> ... until

* the model's turn has no tool call (``no_tool_call``),
* ``max_assistant_turns`` / ``max_user_turns`` is reached (a tool-result round is a user turn),
* the response budget ``response_length`` is spent (model and tool tokens both count; each turn
  may ask for at most what is left, also capped by the context length), or
* a turn comes back ``aborted`` (only with a client that does not resume: the sample is partial).

All turns use one ``request_id``, so routing keeps the trajectory on one replica and its prefix
cache; ``finish_session`` frees the sticky entry at the end. Model tokens get mask 1 and their
logprobs; tool-result tokens (rendered by the chat template, delta only) get mask 0 and logprob
0.0. A tool that raises or times out becomes a tool message; the trajectory survives.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Mapping, Optional

from rollfleet.agent_loop.base import (
    AgentLoopBase,
    AgentLoopContext,
    AgentLoopMetrics,
    AgentLoopOutput,
    token_versions_of,
    versions_of,
)
from rollfleet.agent_loop.registry import register
from rollfleet.agent_loop.tools import BaseTool, ToolSession
from rollfleet.tool_parser import FunctionCall, get_tool_parser
from rollfleet.types import SamplingParams, TokenOutput
from rollfleet.utils import lists


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(self, context: AgentLoopContext, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        self.multi_turn = context.agent.multi_turn
        self.parser = get_tool_parser(self.multi_turn.format)
        self.tools: dict[str, BaseTool] = dict(context.tools)

    def tools_for(self, sample: Mapping[str, Any]) -> dict[str, BaseTool]:
        """The tools of one sample: all of the worker's, or those its ``tool_selection`` names."""
        selection = sample.get("tool_selection")
        if selection is None:
            return self.tools
        unknown = [n for n in selection if n not in self.tools]
        if unknown:
            raise KeyError(f"tool_selection names unknown tools {unknown}; available: {sorted(self.tools)}")
        return {n: self.tools[n] for n in selection}

    def _calls(self, text: str) -> list[FunctionCall]:
        """The turn's tool calls. A call left open is one too, with its error: the turn got here only
        if the model stopped on its own (a budget or context cut ends the trajectory first), and
        dropped, it ended the trajectory as if the model had not tried a tool (the parsers' rule)."""
        parsed = self.parser.parse(text)
        opening = self.parser.call_start
        if opening is None or opening not in parsed.content:
            return parsed.tool_calls
        raw = parsed.content[parsed.content.index(opening) :]
        unclosed = FunctionCall(
            name="",
            id=f"call_{len(parsed.tool_calls)}",
            error=f"tool call opened with {opening} is never closed",
            raw=raw,
        )
        return [*parsed.tool_calls, unclosed]

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        tools = self.tools_for(sample)
        schemas: Optional[list[dict]] = [t.tool_schema for t in tools.values()] or None
        prompt_ids, truncated = self.prompt_ids_of(sample, schemas)
        request_id = self.request_id_for(sample)
        session = ToolSession(tools, self.multi_turn, request_id, sample.get("tools_kwargs"))
        budget = self.budget_of(sampling_params)
        want_logprobs = self.rollout.calculate_log_probs

        response: list[int] = []
        mask: list[int] = []
        logprobs: Optional[list[float]] = [] if want_logprobs else None
        outputs: list[TokenOutput] = []
        metrics = AgentLoopMetrics()
        tool_rewards: list[float] = []
        tool_errors: Counter[str] = Counter()
        assistant_turns = user_turns = 0
        termination = "budget"
        versions: Optional[list[int]] = []  # per response token; None once a turn lacks them
        try:
            while True:
                max_tokens = self.room_for(len(prompt_ids) + len(response), budget - len(response))
                if max_tokens <= 0:
                    termination = "budget" if len(response) >= budget else "context_full"
                    break
                start = time.perf_counter()
                out = await self.client.generate(
                    request_id,
                    prompt_ids=prompt_ids + response,
                    sampling_params=self.turn_params(sampling_params, max_tokens),
                )
                metrics.generate_sequences += time.perf_counter() - start
                metrics.num_generate_calls += 1
                metrics.num_preempted += out.num_preempted or 0
                metrics.num_resumes += int(out.extra_fields.get("num_resumes", 0) or 0)
                outputs.append(out)
                new = list(out.token_ids[:max_tokens])
                response += new
                mask += [1] * len(new)
                if versions is not None:
                    turn_versions = token_versions_of(out, len(new))
                    versions = None if turn_versions is None else versions + turn_versions
                if logprobs is not None:
                    if out.log_probs is None:
                        logprobs = None  # the engine gave none: report none rather than zeros
                    else:
                        logprobs += lists.floats(out.log_probs[: len(new)])
                assistant_turns += 1

                if out.stop_reason == "aborted":
                    termination = "aborted"
                    break
                if len(response) >= budget:
                    termination = "budget"
                    break
                if out.stop_reason == "length":
                    termination = "context_full"
                    break
                if self.multi_turn.max_assistant_turns and assistant_turns >= self.multi_turn.max_assistant_turns:
                    termination = "max_assistant_turns"
                    break
                # Special tokens kept: some tokenizers mark <tool_call> special, and parsers only
                # look for their own markers anyway.
                calls = self._calls(self.chat.decode(new, skip_special_tokens=False))
                if not calls:
                    termination = "no_tool_call"
                    break
                if self.multi_turn.max_user_turns and user_turns >= self.multi_turn.max_user_turns:
                    termination = "max_user_turns"
                    break

                start = time.perf_counter()
                outcomes = await session.run(calls)
                metrics.tool_calls += time.perf_counter() - start
                metrics.num_tool_calls += len(outcomes)
                for outcome in outcomes:
                    if outcome.reward is not None:
                        tool_rewards.append(outcome.reward)
                    if outcome.error is not None:
                        tool_errors[outcome.error] += 1
                delta = self.chat.delta_ids(
                    [o.message() for o in outcomes], schemas, last_token_id=new[-1] if new else None
                )
                # What the context still holds of the results (the budget aside, the model's turns
                # are the only ones room_for caps): past it, the trajectory outgrew max_model_len.
                room = self.room_for(len(prompt_ids) + len(response), budget - len(response))
                cut = len(delta) > room
                delta = delta[:room]
                user_turns += 1
                response += delta
                mask += [0] * len(delta)
                if versions is not None:
                    versions += [-1] * len(delta)
                if logprobs is not None:
                    logprobs += [0.0] * len(delta)
                if len(response) >= budget:
                    termination = "budget"
                    break
                if cut:
                    termination = "context_full"
                    break
        finally:
            self.client.finish_session(request_id)
            await session.release_all()

        response, mask = response[:budget], mask[:budget]
        if versions is not None:
            versions = versions[:budget]
        if logprobs is not None:
            logprobs = logprobs[:budget]
        low, high = versions_of(outputs)
        extra = {
            "request_id": request_id,
            "prompt_truncated": truncated,
            "min_global_steps": low,
            "max_global_steps": high,
            "turn_scores": [],
            "tool_rewards": tool_rewards,
            "tool_errors": dict(tool_errors),
            "termination": termination,
            "stop_reason": outputs[-1].stop_reason if outputs else None,
            "replica_ids": [o.extra_fields.get("replica_id") for o in outputs],
            "assistant_turns": assistant_turns,
            "user_turns": user_turns,
            # a turn whose client gave up resuming it: the trainer masks the partial trajectory out
            "resume_exhausted": any(bool(o.extra_fields.get("resume_exhausted")) for o in outputs),
        }
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response,
            response_mask=mask,
            response_logprobs=logprobs,
            num_turns=assistant_turns + user_turns + 1,
            metrics=metrics,
            extra_fields=extra,
            response_versions=versions,
        )


__all__ = ["ToolAgentLoop"]
