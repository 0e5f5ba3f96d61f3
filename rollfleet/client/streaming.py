"""Streamed generation through the fleet: tokens as the engine samples them, and a generation that
outlives the replica it started on.

A stream yields :class:`~rollfleet.types.TokenDelta` s as they arrive over the data plane, then
one whole :class:`~rollfleet.types.TokenOutput` (the authority; it adds up the attempts). What
makes it more than a pipe is the resume rule the non-streamed client applies to aborts, applied
to everything that cuts a stream short:

* the replica fails mid-stream (its process dies, its connection drops, it is declared dead):
  the replica is quarantined and the generation goes on elsewhere with the prompt plus the tokens
  already received and the budget left; the caller sees the same stream continue, never a token
  twice;
* the attempt comes back ``aborted`` (a weight update in ``abort`` mode): with a resuming client
  (``partial_rollout``) it goes on likewise, on the new weights;
* failures in a row that bring no token count against ``retry.max_attempts``, and so do aborts in
  a row with no new token and no new weights (then the partial output comes back flagged
  ``resume_exhausted``): the rules of :meth:`~rollfleet.client.FullyAsyncLLMServerClient.generate`;
  bad input is raised at once;
* a failure after an attempt's output (the connection drops as the stream's end is read) ends
  nothing: that generation is over, and resending it would run past its stop.

Handles without a streaming call (a Ray actor without a data plane) answer with the whole output,
sent as one delta. The whole output says what :meth:`~rollfleet.client.LLMServerClient.generate`
says of the same attempts: logprobs or per-token versions that an attempt's output lacks are
None for the whole, not filled in.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Optional, Union, cast

from rollfleet.client.budget import StallCount, resumed_params, room_after, token_budget
from rollfleet.client.prompt import checked_params
from rollfleet.client.retry import is_replica_failure, is_retryable, unwrap
from rollfleet.errors import NoServerAvailable, RetriesExhausted
from rollfleet.types import ReplicaResponse, SamplingParams, TokenDelta, TokenOutput
from rollfleet.utils import virtual_time
from rollfleet.utils.refs import within

if TYPE_CHECKING:  # pragma: no cover
    from rollfleet.client.llm_client import LLMServerClient

logger = logging.getLogger(__name__)


@dataclass
class _Sofar:
    """What the stream has delivered, over every attempt, kept as :meth:`generate` would give it
    for the same attempts: logprobs or versions that some attempt did not give are unknown (None)
    for the whole output, never made up."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[Optional[int]] = field(default_factory=list)
    num_preempted: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: Every token's version is known (a replica's output may say they are not: None).
    versions_known: bool = True
    #: ``min_global_steps`` of the first attempt that brought tokens, ``max_global_steps`` of the
    #: last: the versions of the first and last token when the per-token list is unknown.
    first_version: Optional[int] = None
    last_version: Optional[int] = None
    #: The first tokens' attempt is over (``first_version`` is theirs, None if unknown): a later
    #: attempt's version must not stand in for tokens sampled before it.
    first_fixed: bool = False

    def add(self, delta: TokenDelta) -> None:
        n = len(delta.token_ids)
        self.token_ids += delta.token_ids
        if len(delta.log_probs) == n:
            self.log_probs += delta.log_probs
        else:  # kept aligned with the tokens; the output may still bring them
            self.log_probs += [math.nan] * n
        if len(delta.token_versions) == n:
            self.versions += delta.token_versions
        else:
            self.versions += [None] * n

    def settle(self, start: int, out: TokenOutput) -> None:
        """The attempt's whole output is the authority for its span: its logprobs and versions (an
        engine may learn a token's version only at the end) replace what the deltas said, and where
        it has none, none are known."""
        n = len(out.token_ids)
        if out.log_probs is not None and len(out.log_probs) == n:
            self.log_probs[start : start + n] = out.log_probs
        else:  # unknown (NaN, as a delta without them): the whole output then has none
            self.log_probs[start : start + n] = [math.nan] * n
        if out.token_versions is not None and len(out.token_versions) == n:
            self.versions[start : start + n] = out.token_versions
        elif n:
            self.versions_known = False
        if n:
            extra = out.extra_fields
            if not self.first_fixed:
                self.first_version = extra.get("min_global_steps", extra.get("global_steps"))
                self.first_fixed = True
            self.last_version = extra.get("max_global_steps", extra.get("global_steps"))
        self.num_preempted += out.num_preempted or 0
        self.attempts.append(dict(out.extra_fields))

    def cut(self, start: int, error: BaseException) -> None:
        """An attempt failed after its deltas brought the tokens from ``start`` on, and no output
        will settle them: their versions are what the deltas said. Where a delta did not say (vLLM
        learns a token's version only at the end), they are unknown, for the whole output too; the
        next attempt's weights must not label them."""
        span = self.versions[start:]
        if not span:
            return
        known = [v for v in span if v is not None]
        whole = len(known) == len(span)
        if not whole:
            self.versions_known = False
        if not self.first_fixed:
            self.first_version = min(known) if whole else None
            self.first_fixed = True
        self.last_version = max(known) if whole else None
        self.attempts.append({"failed": repr(error), "tokens": len(span)})  # it was resumed: one attempt


async def stream_generate(
    client: "LLMServerClient",
    request_id: str,
    prompt_ids: list[int],
    sampling_params: Optional[SamplingParams] = None,
    **kwargs: Any,
) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
    """See the module docstring."""
    await client.fleet.ensure_started()
    params: SamplingParams = dict(checked_params(sampling_params))
    key, budget = token_budget(
        params, client.config.response_length, room_after(client.config.max_model_len, prompt_ids)
    )
    resumes = bool(getattr(client, "partial_rollout", False))
    sofar = _Sofar()
    failures = 0  # failed tries in a row that brought no token: generate()'s retries of one attempt
    stalls = StallCount(client.retry.max_attempts)  # generate()'s rule for aborts
    no_server_since: Optional[float] = None
    no_server_waits = 0  # the backoff's step while no replica is routable (generate()'s, too)
    stop_reason = "aborted"
    last: Optional[TokenOutput] = None
    while len(sofar.token_ids) < budget:
        before = len(sofar.token_ids)
        attempt_params = resumed_params(params, key, budget, before)
        attempt = cast(
            AsyncGenerator, _attempt(client, request_id, list(prompt_ids) + sofar.token_ids, attempt_params, kwargs)
        )
        settled = False  # the attempt's output is in: the attempt is over, whatever follows
        try:
            async for item in attempt:
                if isinstance(item, TokenDelta):
                    sofar.add(item)
                    yield item
                    continue
                out = item
                rest = out.token_ids[len(sofar.token_ids) - before :]  # what no delta carried
                if rest:
                    n = len(rest)
                    lps = out.log_probs if out.log_probs is not None and len(out.log_probs) >= n else [math.nan] * n
                    vs = (
                        out.token_versions
                        if out.token_versions is not None and len(out.token_versions) >= n
                        else [None] * n
                    )
                    tail = TokenDelta(rest, list(lps[-n:]), list(vs[-n:]))
                    sofar.add(tail)
                    yield tail
                sofar.settle(before, out)
                settled = True
                last, stop_reason = out, out.stop_reason
        except Exception as raw:
            exc = unwrap(raw)
            if settled:
                # e.g. the connection dropped after the last frame: the generation had ended (the
                # replica is quarantined all the same); resending it would run past its stop.
                logger.debug("request %s: %r after its output; the output stands", request_id, exc)
            else:
                sofar.cut(before, exc)
                if not is_retryable(exc):
                    raise exc from (None if exc is raw else raw)
                if _ends_on_a_stop(params, sofar.token_ids):
                    # cut between its stop token's delta and its output: resumed, it ran past the stop
                    logger.debug("request %s: %r after a stop token; the output stands", request_id, exc)
                    stop_reason = "stop"
                    break
                if isinstance(exc, NoServerAvailable):
                    no_server_since = no_server_since or virtual_time.now()
                    if virtual_time.now() - no_server_since > client.config.retry.no_server_wait_s:
                        raise RetriesExhausted(request_id, failures + 1, exc) from exc
                    # backing off as generate() does: at the floor each time, thousands of open
                    # streams spun through a fleet-wide restart (3,005 tries a stream in 30 s)
                    no_server_waits += 1
                    await client.retry.wait(no_server_waits)
                    continue
                no_server_since, no_server_waits = None, 0
                if len(sofar.token_ids) == before:
                    failures += 1  # a failure that brought nothing: bounded; one that did is a resume
                    if failures >= client.retry.max_attempts:
                        raise RetriesExhausted(request_id, failures, exc) from exc
                else:
                    failures = 0
                await client.retry.wait(max(1, failures))
                continue
        finally:
            await attempt.aclose()  # at once: it releases the replica and cancels its request
        no_server_since, no_server_waits = None, 0
        failures = 0
        if stop_reason != "aborted" or not resumes or len(sofar.token_ids) >= budget:
            break
        assert last is not None  # settled
        version = last.extra_fields.get("global_steps")
        new = len(sofar.token_ids) > before
        stalled = stalls.after_abort(new, len(sofar.attempts) > 1, version, client.fleet.current_version)
        if stalls.exhausted:
            break
        if stalled:
            await client.retry.wait(stalled)
    yield _whole(sofar, last, stop_reason, budget, stalls.exhausted)


async def _attempt(
    client: "LLMServerClient", request_id: str, prompt: list[int], params: SamplingParams, kwargs: dict[str, Any]
) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
    """One attempt on one replica: its deltas, then its output; the replica is released however
    the attempt ends, and quarantined when it failed."""
    try:
        server_id, handle = await client._acquire(request_id, len(prompt), prompt)
    except BaseException:
        await client._release(None, len(prompt), request_id, ended=False)
        raise
    kwargs = {**kwargs, "client_id": client.balancer.client_id}
    ended = False  # an output came back that was not aborted (the gate times probes by it)
    observed = False  # the balancer saw the attempt's output (its versions with it)
    newest: Optional[int] = None  # the newest weight version the attempt's deltas carried
    # generate()'s limit on one attempt: a replica that hangs without dying fails the attempt (it
    # is quarantined, the stream goes on elsewhere), not the stream. Only the time spent waiting
    # for the replica counts, not the caller's between two deltas: a slow reader is no failure.
    timeout = client.config.retry.request_timeout_s
    loop = asyncio.get_running_loop()
    try:
        stream_call = getattr(handle, "stream_generate", None)
        try:
            if stream_call is None:
                ref = handle.generate_with_load.remote(request_id, prompt, params, **kwargs)
                response = await within(ref, timeout)  # gone or out of time: the replica's request stops too
                client.balancer.report_load(response.load, handle)
                client.balancer.observe_output(server_id, request_id, response.output)
                observed = True
                ended = response.output.stop_reason != "aborted"
                yield response.output
                return
            stream = cast(AsyncGenerator, stream_call(request_id, prompt, params, **kwargs))
            try:
                left = timeout
                while True:
                    step = stream.__anext__()
                    began = loop.time()
                    try:
                        item = await (step if left is None else asyncio.wait_for(step, left))
                    except StopAsyncIteration:
                        break
                    if left is not None:
                        left = max(0.0, left - (loop.time() - began))
                    if isinstance(item, ReplicaResponse):
                        client.balancer.report_load(item.load, handle)
                        client.balancer.observe_output(server_id, request_id, item.output)
                        observed = True
                        ended = item.output.stop_reason != "aborted"
                        yield item.output
                    else:
                        for v in item.token_versions:
                            if v is not None and (newest is None or v > newest):
                                newest = v
                        yield item
            finally:
                await stream.aclose()
        except Exception as raw:
            exc = unwrap(raw)
            if is_replica_failure(exc):
                client.fleet.quarantine(server_id, repr(exc))
                client.balancer.unstick(request_id)  # the session moves on to another replica
            raise
    finally:
        if not observed:  # cut short: what it delivered still binds the session (no step back)
            client.balancer.observe_version(server_id, request_id, newest)
        await client._release(server_id, len(prompt), request_id, ended, handle)


def _ends_on_a_stop(params: SamplingParams, token_ids: list[int]) -> bool:
    """Whether the last token delivered is one of the caller's ``stop_token_ids`` (past
    ``min_tokens``): the generation ended there. (The model's EOS is the engine's to know: a cut
    right after it is resumed, and resends the turn's end.)"""
    stops = params.get("stop_token_ids") or ()
    floor = params.get("min_tokens") or params.get("min_new_tokens") or 0
    return bool(token_ids) and token_ids[-1] in stops and len(token_ids) > floor


def _whole(sofar: _Sofar, last: Optional[TokenOutput], stop_reason: str, budget: int, exhausted: bool) -> TokenOutput:
    if len(sofar.token_ids) >= budget and stop_reason == "aborted":
        stop_reason = "length"
    extra = dict(last.extra_fields) if last is not None else {}
    log_probs: Optional[list[float]] = sofar.log_probs
    if any(math.isnan(x) for x in sofar.log_probs):
        log_probs = None
    versions: Optional[list[Optional[int]]] = sofar.versions if sofar.versions_known else None
    known = [v for v in versions if v is not None] if versions is not None else []
    if known:
        extra["min_global_steps"], extra["max_global_steps"] = min(known), max(known)
    elif sofar.first_fixed:  # tokens whose versions are unknown: the attempts' own, None where unknown
        extra["min_global_steps"], extra["max_global_steps"] = sofar.first_version, sofar.last_version
    extra["num_resumes"] = max(0, len(sofar.attempts) - 1)
    extra["attempts"] = sofar.attempts
    if exhausted:
        extra["resume_exhausted"] = True
    return TokenOutput(
        token_ids=sofar.token_ids,
        log_probs=log_probs,
        stop_reason=stop_reason,
        num_preempted=sofar.num_preempted,
        token_versions=versions,
        extra_fields=extra,
    )


__all__ = ["stream_generate"]
