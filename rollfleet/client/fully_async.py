"""``FullyAsyncLLMServerClient``: makes an abort (weight update, abort_all) invisible.

After an ``aborted`` attempt it resends prompt + tokens so far with the remaining budget, on
whatever replica routing picks (normally the same one: the request id is sticky), until the
response stops or the budget is spent. Interruption contract:

* the budget is ``max_tokens`` or ``max_new_tokens`` from the caller, else the configured
  ``response_length``; the total never exceeds it, and a budget spent by resumes ends ``length``;
* the caller's ``sampling_params`` dict is never mutated;
* ``**kwargs`` reach the server on every attempt (verl's first version dropped them);
* token ids, logprobs, per-token versions and preemptions add up across attempts;
  ``min_global_steps`` / ``max_global_steps`` are the versions of the first and last token;
  each attempt's ``extra_fields`` are kept under ``extra_fields["attempts"]`` (verl drops them);
* resumes are not failures: an aborted attempt that brought new tokens, or after which the
  weights changed (a weight update aborted it), is resumed at once and never counts against
  ``retry.max_attempts``: a generation goes on for as long as it has budget left, however often
  the trainer syncs. Only aborts that make no progress at all (an ``abort_all`` storm) count, with
  the retry policy's backoff between them; when ``max_attempts`` of those come in a row, the
  partial output returns with ``stop_reason="aborted"`` and ``extra_fields["resume_exhausted"] =
  True`` instead of looping (verl sleeps a fixed second and loops forever).
"""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.client.budget import StallCount, resumed_params, room_after, token_budget
from rollfleet.client.llm_client import LLMServerClient, WeightsMoved
from rollfleet.client.prompt import checked_params, checked_prompt
from rollfleet.types import SamplingParams, StopReason, TokenOutput


class FullyAsyncLLMServerClient(LLMServerClient):
    """Same signature as :class:`LLMServerClient`; resumes aborted requests transparently.

    ``partial_rollout=False`` keeps every response one policy's: an aborted request is resumed
    only on a replica serving the weights that sampled its tokens so far (a pause with no weight
    sync after it), else it comes back ``aborted`` so the caller regenerates it rather than
    training on a truncated or mixed sample.
    """

    def __init__(self, *args: Any, partial_rollout: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.partial_rollout = partial_rollout
        self.init_kwargs["partial_rollout"] = partial_rollout  # a pickled copy keeps the setting

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> TokenOutput:
        params: SamplingParams = dict(checked_params(sampling_params))
        prompt = checked_prompt(prompt_ids)
        key, budget = token_budget(params, self.config.response_length, room_after(self.config.max_model_len, prompt))

        token_ids: list[int] = []
        log_probs: Optional[list[float]] = []
        versions: Optional[list[Optional[int]]] = []
        attempts: list[dict[str, Any]] = []
        num_preempted = 0
        first_version = last_version = None
        stop_reason: StopReason = "aborted"
        last_extra: dict[str, Any] = {}
        attempt = 0
        stalls = StallCount(self.retry.max_attempts)
        pinned: Optional[int] = None  # partial_rollout off: the one version a resume may run on

        while True:
            attempt += 1
            attempt_params = resumed_params(params, key, budget, len(token_ids))
            try:
                out = await self._generate(request_id, prompt + token_ids, attempt_params, kwargs, pinned)
            except WeightsMoved:
                attempt -= 1  # not sent
                break  # back aborted, as it was: the caller regenerates it
            if pinned is not None and not _sampled_by(out, pinned):
                break  # other weights after all (a commit after it was routed): dropped, back aborted
            new = out.token_ids[: budget - len(token_ids)]  # defensive: an engine never gets more
            token_ids.extend(new)
            if log_probs is not None and out.log_probs is not None:
                log_probs.extend(out.log_probs[: len(new)])
            else:
                log_probs = None
            if versions is not None and out.token_versions is not None:
                versions.extend(out.token_versions[: len(new)])
            else:
                versions = None
            num_preempted += out.num_preempted or 0
            last_extra = out.extra_fields
            attempts.append(dict(out.extra_fields))
            if new:
                if first_version is None:
                    first_version = out.extra_fields.get("min_global_steps")
                last_version = out.extra_fields.get("max_global_steps")
            stop_reason = out.stop_reason
            if len(token_ids) >= budget:
                if stop_reason == "aborted":
                    stop_reason = "length"
                break
            if stop_reason != "aborted":
                break
            if not self.partial_rollout and token_ids:
                # Its tokens must stay one policy's: resumed only on the weights that sampled them
                # (an abort with no weight sync after it: every step of colocate_async pauses the
                # fleet), else returned aborted. A version not known: returned as before.
                if last_version is None:
                    break
                pinned = last_version
            version = out.extra_fields.get("global_steps")
            stalled = stalls.after_abort(bool(new), attempt > 1, version, self.fleet.current_version)
            if stalls.exhausted:
                break
            if stalled:
                await self.retry.wait(stalled)

        extra = dict(last_extra)
        final_version = last_extra.get("global_steps")
        extra["global_steps"] = final_version
        extra["min_global_steps"] = first_version if first_version is not None else final_version
        extra["max_global_steps"] = last_version if last_version is not None else final_version
        extra["num_resumes"] = attempt - 1
        extra["attempts"] = attempts
        if stalls.exhausted:
            extra["resume_exhausted"] = True
        # model_construct: every part was validated when its attempt's TokenOutput was built.
        return TokenOutput.model_construct(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason=stop_reason,
            num_preempted=num_preempted,
            token_versions=versions if versions is not None and len(versions) == len(token_ids) else None,
            extra_fields=extra,
        )


def _sampled_by(out: TokenOutput, version: int) -> bool:
    """Every token of ``out`` was sampled by ``version`` (an output with none was: nothing to mix)."""
    if not out.token_ids:
        return True
    if out.token_versions is not None:
        return all(v == version for v in out.token_versions)
    extra = out.extra_fields
    return extra.get("min_global_steps") == version == extra.get("max_global_steps")


__all__ = ["FullyAsyncLLMServerClient"]
