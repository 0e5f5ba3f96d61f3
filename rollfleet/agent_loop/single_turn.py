"""``single_turn_agent``: one generation per trajectory (verl's ``SingleTurnAgentLoop``).

The whole response is the model's (mask 1); ``num_turns`` is 2 (user + assistant) as in verl.
"""

from __future__ import annotations

import time
from typing import Any

from rollfleet.agent_loop.base import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, token_versions_of, versions_of
from rollfleet.agent_loop.registry import register
from rollfleet.types import SamplingParams
from rollfleet.utils import lists


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        prompt_ids, truncated = self.prompt_ids_of(sample)
        request_id = self.request_id_for(sample)
        metrics = AgentLoopMetrics()
        max_tokens = self.room_for(len(prompt_ids), self.budget_of(sampling_params))
        extra: dict[str, Any] = {"request_id": request_id, "prompt_truncated": truncated}
        if max_tokens <= 0:
            extra["termination"] = "context_full"
            return AgentLoopOutput(
                prompt_ids,
                [],
                [],
                [] if self.rollout.calculate_log_probs else None,
                num_turns=2,
                metrics=metrics,
                extra_fields=extra,
            )
        params = self.turn_params(sampling_params, max_tokens)
        start = time.perf_counter()
        try:
            out = await self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=params)
        finally:
            metrics.generate_sequences = time.perf_counter() - start
            self.client.finish_session(request_id)
        response = list(out.token_ids[: self.response_length])
        logprobs = None
        if self.rollout.calculate_log_probs and out.log_probs is not None:
            logprobs = lists.floats(out.log_probs[: len(response)])
        metrics.num_generate_calls = 1
        metrics.num_preempted = out.num_preempted or 0
        metrics.num_resumes = int(out.extra_fields.get("num_resumes", 0) or 0)
        low, high = versions_of([out])
        extra.update(
            {k: v for k, v in out.extra_fields.items() if k not in ("attempts", "min_global_steps", "max_global_steps")}
        )
        extra.update(
            min_global_steps=low,
            max_global_steps=high,
            stop_reason=out.stop_reason,
            termination=out.stop_reason,
            replica_ids=[out.extra_fields.get("replica_id")],
        )
        return AgentLoopOutput(
            prompt_ids,
            response,
            [1] * len(response),
            logprobs,
            num_turns=2,
            metrics=metrics,
            extra_fields=extra,
            response_versions=token_versions_of(out, len(response)),
        )


__all__ = ["SingleTurnAgentLoop"]
