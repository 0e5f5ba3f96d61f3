"""Streamed generation through the client, on in-process sim replicas (no Ray): tokens arrive as
the engine samples them, and a stream cut short by a dead replica or an abort goes on elsewhere
from the tokens already received, never repeating one, asking for what is left of every budget
and minimum the caller gave (streamed or not). On scripted replicas: a stream that fails
after its output is over, and a streamed output says of logprobs and versions what generate()
says."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollfleet.client import FullyAsyncLLMServerClient, LLMServerClient
from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.errors import InvalidRequest, ReplicaUnavailable
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica
from rollfleet.types import LoadReport, ReplicaResponse, TokenDelta, TokenOutput

pytestmark = pytest.mark.unit

PROMPT = [5, 6, 7, 8]


async def fleet(n: int, client_cls: type = LLMServerClient, time_scale: float = 2.0):
    config = RolloutConfig(
        name="sim",
        prompt_length=64,
        response_length=400,
        max_model_len=1024,
        sim=SimEngineConfig(vocab_size=300, eos_token_id=299, time_scale=time_scale),
        retry={"max_attempts": 5, "initial_backoff_s": 0.01, "max_backoff_s": 0.05},
    )
    replicas = [Replica(f"r{i}", config, i) for i in range(n)]
    for r in replicas:
        await r.start(version=0)
    prompts: list[tuple[str, list[int]]] = []
    for r in replicas:  # record what each replica was asked to continue from
        stream = r.generate_stream

        def recording(request_id: str, prompt_ids: list[int], *a: Any, _r: Replica = r, _s: Any = stream, **k: Any):
            prompts.append((_r.replica_id, list(prompt_ids)))
            return _s(request_id, prompt_ids, *a, **k)

        r.generate_stream = recording  # type: ignore[method-assign]
    client = client_cls(config, servers={r.replica_id: LocalHandle(r) for r in replicas})
    return replicas, client, prompts


async def collect(stream: Any, on_delta: Any = None) -> tuple[list[TokenDelta], TokenOutput, list[float]]:
    deltas, stamps = [], []
    final = None
    async for item in stream:
        if isinstance(item, TokenDelta):
            deltas.append(item)
            stamps.append(time.monotonic())
            if on_delta is not None:
                await on_delta(deltas)
        else:
            final = item
    assert final is not None
    return deltas, final, stamps


async def test_tokens_arrive_as_they_are_sampled_and_add_up_to_the_output():
    replicas, client, _ = await fleet(1)
    started = time.monotonic()
    params = {"max_tokens": 200, "ignore_eos": True}
    deltas, out, stamps = await collect(client.generate_stream("s", prompt_ids=PROMPT, sampling_params=params))
    ended = time.monotonic()
    assert len(deltas) > 10
    assert [t for d in deltas for t in d.token_ids] == out.token_ids and len(out.token_ids) == 200
    assert [lp for d in deltas for lp in d.log_probs] == out.log_probs
    assert out.stop_reason == "length" and set(out.token_versions) == {0}
    assert stamps[0] - started < 0.2 * (ended - started)  # the first token long before the last
    assert client.balancer.get_total_inflight() == 0
    for r in replicas:
        await r.shutdown()


async def test_a_replica_that_dies_mid_stream_is_replaced_and_the_stream_goes_on_from_its_tokens():
    replicas, client, prompts = await fleet(2)
    params = {"max_tokens": 200, "ignore_eos": True}
    crashed: list[str] = []

    async def crash_after_some(deltas: list[TokenDelta]) -> None:
        if not crashed and sum(len(d.token_ids) for d in deltas) >= 40:
            serving = prompts[-1][0]
            next(r for r in replicas if r.replica_id == serving).engine.inject_fault("crash")
            crashed.append(serving)

    deltas, out, _ = await collect(
        client.generate_stream("s", prompt_ids=PROMPT, sampling_params=params), crash_after_some
    )
    assert len(out.token_ids) == 200 and out.stop_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == out.token_ids  # nothing repeated, nothing lost
    (first, p1), (second, p2) = prompts
    assert first == crashed[0] and second != first
    received = len(p2) - len(PROMPT)
    assert received >= 40 and p2 == PROMPT + out.token_ids[:received]  # continued from what arrived
    assert client.balancer.get_total_inflight() == 0
    for r in replicas:
        await r.shutdown()


async def test_an_abort_mid_stream_is_resumed_by_a_resuming_client_and_ends_a_plain_one():
    for client_cls, resumed in ((FullyAsyncLLMServerClient, True), (LLMServerClient, False)):
        replicas, client, prompts = await fleet(1, client_cls)
        params = {"max_tokens": 150, "ignore_eos": True}

        async def update_after_some(deltas: list[TokenDelta], prompts=prompts, replicas=replicas) -> None:
            if len(prompts) == 1 and sum(len(d.token_ids) for d in deltas) >= 30:
                asyncio.ensure_future(replicas[0].update_weights({"w": 1}, 1))  # abort mode: in-flight ends

        replicas[0].config.weight_sync.mode = "abort"
        deltas, out, _ = await collect(
            client.generate_stream("s", prompt_ids=PROMPT, sampling_params=params), update_after_some
        )
        if resumed:
            assert len(out.token_ids) == 150 and len(prompts) == 2 and out.extra_fields["num_resumes"] == 1
            assert {0, 1} <= set(out.token_versions)
        else:
            assert out.stop_reason == "aborted" and len(out.token_ids) < 150 and len(prompts) == 1
        assert [t for d in deltas for t in d.token_ids] == out.token_ids
        assert client.balancer.get_total_inflight() == 0
        for r in replicas:
            await r.shutdown()


async def test_leaving_a_stream_early_aborts_the_generation_and_frees_the_replica():
    replicas, client, _ = await fleet(1)
    stream = client.generate_stream("s", prompt_ids=PROMPT, sampling_params={"max_tokens": 400, "ignore_eos": True})
    async for item in stream:
        assert isinstance(item, TokenDelta)
        break
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)
    assert client.balancer.get_total_inflight() == 0
    assert replicas[0].engine.stats()["num_aborted"] == 1 and replicas[0]._book.requests == 0
    for r in replicas:
        await r.shutdown()


# ---------------------------------------------------------------- handles that script one attempt
def _output(log_probs: Any, versions: Any, first: int = 0, last: int = 0, stop: str = "stop") -> TokenOutput:
    extra = {"global_steps": last, "min_global_steps": first, "max_global_steps": last}
    return TokenOutput(
        token_ids=[11, 12, 13], log_probs=log_probs, token_versions=versions, stop_reason=stop, extra_fields=extra
    )


class _Scripted:
    """A streaming handle: one delta, then the output; optionally a replica failure after both
    (the connection dropping while the end of the stream is read)."""

    def __init__(self, name: str, delta: TokenDelta, final: TokenOutput, fail_after: bool = False) -> None:
        self.name, self.delta, self.final, self.fail_after = name, delta, final, fail_after
        self.calls: list[list[int]] = []

    async def stream_generate(self, request_id: str, prompt_ids: list[int], params: Any, **kwargs: Any):
        self.calls.append(list(prompt_ids))
        yield self.delta
        yield ReplicaResponse(self.final, LoadReport(replica_id=self.name))
        if self.fail_after:
            raise ReplicaUnavailable(self.name, "connection dropped after the last frame")


class _Whole:
    """A handle without a data plane (a Ray actor): the whole output at once."""

    def __init__(self, final: TokenOutput) -> None:
        self.final = final

    async def generate_with_load(self, request_id: str, prompt_ids: list[int], params: Any, **kwargs: Any):
        return ReplicaResponse(self.final, LoadReport(replica_id="s0"))


async def _stream_once(servers: dict[str, Any]) -> tuple[LLMServerClient, TokenOutput]:
    config = RolloutConfig(response_length=64, retry={"initial_backoff_s": 0.0, "jitter": 0.0})
    client = LLMServerClient(config, servers=servers)
    _, final, _ = await collect(client.generate_stream("r", prompt_ids=[1, 2], sampling_params={"max_tokens": 64}))
    return client, final


async def test_a_failure_after_the_output_ends_nothing_and_resends_nothing():
    # Every replica drops its connection after its last frame: the first output is the answer.
    delta = TokenDelta([11, 12, 13], [-0.1] * 3, [0] * 3)
    handles = {n: _Scripted(n, delta, _output([-0.1] * 3, [0] * 3), fail_after=True) for n in ("a", "b")}
    client, final = await _stream_once(handles)
    assert sum(len(h.calls) for h in handles.values()) == 1
    assert final.token_ids == [11, 12, 13] and final.stop_reason == "stop"
    assert final.extra_fields["num_resumes"] == 0
    assert client.balancer.get_total_inflight() == 0


async def test_a_failure_between_a_stop_token_and_the_output_resends_nothing():
    """The stop token's delta arrived, then the connection dropped before the output: the stream
    resumed from prompt + [..., stop] and generated past the stop, returned as stopped."""

    class CutAfterTheStop:
        calls: list[list[int]] = []

        async def stream_generate(self, request_id: str, prompt_ids: list[int], params: Any, **kwargs: Any):
            self.calls.append(list(prompt_ids))
            yield TokenDelta([11, 12, 299], [-0.1] * 3, [0] * 3)
            raise ReplicaUnavailable("a", "connection dropped before the output frame")

    config = RolloutConfig(response_length=64, retry={"initial_backoff_s": 0.0, "jitter": 0.0})
    client = LLMServerClient(config, servers={"a": CutAfterTheStop(), "b": CutAfterTheStop()})
    params = {"max_tokens": 64, "stop_token_ids": [299]}
    _, final, _ = await collect(client.generate_stream("r", prompt_ids=[1, 2], sampling_params=params))
    assert CutAfterTheStop.calls == [[1, 2]]
    assert final.token_ids == [11, 12, 299] and final.stop_reason == "stop"
    assert client.balancer.get_total_inflight() == 0


async def test_a_stream_makes_up_no_logprob_or_version_that_generate_would_not_give():
    # (a) no logprobs at all, from a handle that does not stream: None, as generate() gives
    client = LLMServerClient(
        RolloutConfig(response_length=64), servers={"s0": LocalHandle(_Whole(_output(None, [0] * 3)))}
    )
    plain = await client.generate("r", prompt_ids=[1], sampling_params={"max_tokens": 64})
    _, streamed = await _stream_once({"s0": RayLike(_Whole(_output(None, [0] * 3)))})
    assert plain.log_probs is None and streamed.log_probs is None
    assert streamed.token_ids == [11, 12, 13]
    # (b) deltas without logprobs and an output without them: unknown, not a shorter list
    _, streamed = await _stream_once(
        {"s0": _Scripted("s0", TokenDelta([11, 12, 13], [], [0] * 3), _output(None, [0] * 3))}
    )
    assert streamed.log_probs is None
    # (c) the output says the versions are unknown (a keep-mode commit in the attempt): so is
    # the stream's, and its first/last versions are the replica's, not the deltas' guesses
    delta = TokenDelta([11, 12, 13], [-0.1] * 3, [0] * 3)
    _, streamed = await _stream_once({"s0": _Scripted("s0", delta, _output([-0.1] * 3, None, first=0, last=1))})
    assert streamed.token_versions is None
    assert (streamed.extra_fields["min_global_steps"], streamed.extra_fields["max_global_steps"]) == (0, 1)
    assert streamed.log_probs == [-0.1] * 3


class RayLike:
    """Calls a target the way a Ray actor handle is called: ``handle.generate_with_load.remote(...)``."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return asyncio.ensure_future(method(*args, **kwargs))

        return _Method()


async def _generated(replica: Replica) -> int:
    stats = await replica.stats()
    return int(stats.get("generation_tokens", 0))


async def test_a_resumed_attempt_asks_for_what_is_left_of_every_budget_and_minimum():
    """The caller gives max_tokens and max_new_tokens, and min_tokens. A resume that lowered only
    one budget key was refused by the replica (the two must be equal), and one that kept
    min_tokens asked for more than its budget: either way the rollout failed with its tokens."""
    params = {"max_tokens": 150, "max_new_tokens": 150, "min_tokens": 140, "ignore_eos": True}
    for streamed in (False, True):
        replicas, client, prompts = await fleet(1, FullyAsyncLLMServerClient)
        asked: list[dict[str, Any]] = []
        validate = replicas[0]._admitted

        def spy(
            request_id: str, prompt_ids: Any, sampling_params: Any, client_id: Any, _v: Any = validate, _a: Any = asked
        ) -> Any:
            _a.append(dict(sampling_params))
            return _v(request_id, prompt_ids, sampling_params, client_id)

        replicas[0]._admitted = spy  # type: ignore[method-assign]
        if streamed:
            call = asyncio.ensure_future(
                collect(client.generate_stream("s", prompt_ids=PROMPT, sampling_params=params))
            )
        else:
            call = asyncio.ensure_future(client.generate("s", prompt_ids=PROMPT, sampling_params=params))
        while await _generated(replicas[0]) < 30:
            await asyncio.sleep(0.005)
        await replicas[0].abort_all()
        result = await asyncio.wait_for(call, 30)
        out = result[1] if streamed else result
        assert (len(out.token_ids), out.stop_reason) == (150, "length"), streamed
        assert out.extra_fields["num_resumes"] >= 1
        done = 150 - asked[1]["max_tokens"]  # what the first attempt had generated
        assert done >= 30
        assert asked[1] == {**params, "max_tokens": 150 - done, "max_new_tokens": 150 - done, "min_tokens": 140 - done}
        assert client.balancer.get_total_inflight() == 0
        for r in replicas:
            await r.shutdown()


class _CutOnce:
    """Streaming handles sharing one script: the first attempt anywhere sends three tokens whose
    versions it does not know yet (as vLLM's deltas), then its replica fails (or hangs, with
    ``hang``); every later attempt is on weights 7 and ends."""

    def __init__(self, name: str, shared: dict[str, int], hang: bool = False) -> None:
        self.name, self.shared, self.hang = name, shared, hang

    async def stream_generate(self, request_id: str, prompt_ids: list[int], params: Any, **kwargs: Any):
        self.shared["calls"] = self.shared.get("calls", 0) + 1
        if self.shared["calls"] == 1:
            yield TokenDelta([11, 12, 13], [-0.1] * 3, [None] * 3)
            if self.hang:
                await asyncio.Event().wait()
            raise ReplicaUnavailable(self.name, "the connection dropped mid-stream")
        yield TokenDelta([20, 21, 22], [-0.2] * 3, [None] * 3)
        yield ReplicaResponse(_output([-0.2] * 3, [7] * 3, first=7, last=7), LoadReport(replica_id=self.name))


async def test_tokens_a_failed_attempt_sent_keep_their_unknown_versions_not_the_next_attempts():
    """The first attempt's tokens were sampled by weights nobody reported (its replica failed
    before its output): the whole output's versions are unknown and so is its first version, not
    the resumed attempt's 7, which would make old tokens look fresh to the staleness bound."""
    shared: dict[str, int] = {}
    client, final = await _stream_once({n: _CutOnce(n, shared) for n in ("a", "b")})
    assert final.token_ids == [11, 12, 13, 20, 21, 22] and final.stop_reason == "stop"
    assert final.token_versions is None
    assert (final.extra_fields["min_global_steps"], final.extra_fields["max_global_steps"]) == (None, 7)
    assert final.extra_fields["num_resumes"] == 1
    assert client.balancer.get_total_inflight() == 0


async def test_a_replica_that_hangs_mid_stream_fails_its_attempt_after_request_timeout_s():
    """generate() gives up on an attempt after ``retry.request_timeout_s``; a stream waited forever
    on a replica that hung without dying. Now the attempt fails, the replica is quarantined, and
    the stream goes on elsewhere from its tokens."""
    shared: dict[str, int] = {}
    handles = {n: _CutOnce(n, shared, hang=True) for n in ("a", "b")}
    config = RolloutConfig(
        response_length=64, retry={"initial_backoff_s": 0.0, "jitter": 0.0, "request_timeout_s": 0.3}
    )
    client = LLMServerClient(config, servers=handles)
    stream = client.generate_stream("r", prompt_ids=[1, 2], sampling_params={"max_tokens": 64})
    _, final, _ = await asyncio.wait_for(collect(stream), 10)
    assert final.token_ids == [11, 12, 13, 20, 21, 22] and shared["calls"] == 2
    assert client.balancer.get_total_inflight() == 0


async def test_a_slow_reader_is_not_a_hung_replica():
    """Only the time spent waiting for the replica counts against ``request_timeout_s``: a caller
    that takes longer than it between two deltas does not fail the attempt."""
    delta = TokenDelta([11, 12, 13], [-0.1] * 3, [0] * 3)
    handles = {"a": _Scripted("a", delta, _output([-0.1] * 3, [0] * 3))}
    config = RolloutConfig(response_length=64, retry={"request_timeout_s": 0.2})
    client = LLMServerClient(config, servers=handles)
    _, final, _ = await collect(
        client.generate_stream("r", prompt_ids=[1, 2], sampling_params={"max_tokens": 64}),
        lambda deltas: asyncio.sleep(0.4),
    )
    assert final.token_ids == [11, 12, 13] and len(handles["a"].calls) == 1


@pytest.mark.parametrize("streamed", [False, True])
async def test_max_tokens_and_max_new_tokens_that_differ_are_refused_by_the_resuming_paths(streamed):
    """A plain generate sends the pair and the replica refuses it; the resuming paths used to send
    both set to the first key's budget, so the caller's conflict went through unnoticed."""
    replicas, client, _ = await fleet(1, FullyAsyncLLMServerClient)
    params = {"max_tokens": 10, "max_new_tokens": 100}
    with pytest.raises(InvalidRequest, match=r"sampling_params\.max_new_tokens.*equal to max_tokens \(10\)"):
        if streamed:
            await collect(client.generate_stream("s", prompt_ids=PROMPT, sampling_params=params))
        else:
            await client.generate("s", prompt_ids=PROMPT, sampling_params=params)
    same = await client.generate("t", prompt_ids=PROMPT, sampling_params={"max_tokens": 5, "max_new_tokens": 5})
    assert len(same.token_ids) <= 5
    assert client.balancer.get_total_inflight() == 0
    for r in replicas:
        await r.shutdown()


@pytest.mark.parametrize("client_cls", [LLMServerClient, FullyAsyncLLMServerClient])
def test_a_stream_waiting_for_a_routable_replica_backs_off_as_generate_does(client_cls):
    """The stream retried at the backoff's floor (10 ms) the whole no_server_wait_s: 3,005 tries
    in 30 s where generate() made 37 (a busy loop, and an RPC storm on a shared balancer)."""
    from rollfleet.errors import RetriesExhausted
    from rollfleet.utils import virtual_time

    async def tries(stream: bool) -> int:
        client = client_cls(RolloutConfig(response_length=8, retry={"no_server_wait_s": 30.0}),
                            servers={"A": LocalHandle(object())})  # fmt: skip
        client.balancer.set_routable("A", False)  # the whole fleet restarting
        counted = 0
        acquire = client._acquire

        async def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal counted
            counted += 1
            return await acquire(*args, **kwargs)

        client._acquire = counting  # type: ignore[method-assign]
        with pytest.raises(RetriesExhausted):
            if stream:
                async for _ in client.generate_stream("x", prompt_ids=[1], sampling_params={"max_tokens": 8}):
                    pass
            else:
                await client.generate("x", prompt_ids=[1], sampling_params={"max_tokens": 8})
        return counted

    async def both() -> tuple[int, int]:
        return await tries(stream=False), await tries(stream=True)

    whole, streamed = virtual_time.run(both(), idle_timeout_s=5)
    assert streamed <= 2 * whole, (whole, streamed)


async def test_a_prompt_that_leaves_less_room_than_response_length_is_served_on_every_path():
    """No max_tokens: the resuming paths sent response_length (400) explicitly, and a 700-token
    prompt in a 1,024-token context was refused there while a plain generate got the 324 left."""
    replicas, plain, _ = await fleet(1, time_scale=50.0)
    resuming = FullyAsyncLLMServerClient(replicas[0].config, servers={"r0": LocalHandle(replicas[0])})
    prompt, params = [5] * 700, {"temperature": 1.0, "ignore_eos": True}
    whole = await plain.generate("g", prompt_ids=prompt, sampling_params=params)
    outs = [whole, await resuming.generate("f", prompt_ids=prompt, sampling_params=params)]
    for client in (plain, resuming):
        items = [item async for item in client.generate_stream("s", prompt_ids=prompt, sampling_params=params)]
        outs.append(items[-1])
    assert [(len(o.token_ids), o.stop_reason) for o in outs] == [(324, "length")] * 4
    for r in replicas:
        await r.shutdown()


class _OnVersion:
    """A streaming handle on weights ``version``: with ``cut_after``, it sends that many tokens and
    then its replica fails; otherwise it ends."""

    def __init__(self, name: str, version: int, cut_after: Any = None) -> None:
        self.name, self.version, self.cut_after = name, version, cut_after
        self.calls = 0

    async def stream_generate(self, request_id: str, prompt_ids: list[int], params: Any, **kwargs: Any):
        self.calls += 1
        n = params["max_tokens"]
        for i in range(n):
            if i == self.cut_after:
                raise ReplicaUnavailable(self.name, "the connection dropped mid-stream")
            yield TokenDelta([100 + i], [-0.1], [self.version])
        versions = [self.version] * n
        final = _output([-0.1] * n, versions, first=self.version, last=self.version, stop="length")
        final.token_ids = [100 + i for i in range(n)]
        yield ReplicaResponse(final, LoadReport(replica_id=self.name))


async def test_a_stream_cut_short_resumes_on_weights_no_older_than_the_tokens_it_delivered():
    """A rolling update: ``new`` is on weights 2 and fails after three tokens sampled there; of the
    two left, ``old`` is still on 1 and the least loaded. The floor used to come only from a whole
    output, so the resumed attempt went to ``old`` and the trajectory stepped back a version."""
    handles = {"new": _OnVersion("new", 2, cut_after=3), "old": _OnVersion("old", 1), "new2": _OnVersion("new2", 2)}
    config = RolloutConfig(routing={"policy": "least_inflight"}, retry={"initial_backoff_s": 0.0, "jitter": 0.0})
    client = LLMServerClient(config, servers=handles)
    for name, version in (("new", 2), ("old", 1), ("new2", 2)):
        client.balancer.set_version(name, version)
    client.balancer.report_load(LoadReport(replica_id="new2", inflight=3, inflight_tokens=30, timestamp=1.0))
    client.balancer.report_load(LoadReport(replica_id="old", inflight=1, inflight_tokens=10, timestamp=1.0))
    _, final, _ = await collect(client.generate_stream("s", prompt_ids=[1, 2], sampling_params={"max_tokens": 6}))
    assert (handles["new"].calls, handles["old"].calls, handles["new2"].calls) == (1, 0, 1)
    assert final.token_versions == [2] * 6
    assert client.balancer.decisions["version_regressed"] == 0
    assert client.balancer.get_total_inflight() == 0


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("client_cls", [LLMServerClient, FullyAsyncLLMServerClient])
@pytest.mark.parametrize("policy", ["least_tokens", "prefix_affinity"])
async def test_a_prompt_routing_cannot_read_is_refused_naming_the_field(streamed, client_cls, policy):
    """None, a number or nested lists used to fail in routing with a bare TypeError (a length, or
    a digest of the ids), before the replica's check that names the field; nothing is counted.
    Sampling parameters that are no dict likewise."""
    config = RolloutConfig(response_length=8, routing={"policy": policy})
    client = client_cls(config, servers={"a": _OnVersion("a", 0)})
    cases = [(None, "prompt_ids"), (7, "prompt_ids")]
    if policy == "prefix_affinity":  # its digest of the ids reads them first (else the replica names it)
        cases.append(([1, [2, 3]], "prompt_ids[1]"))
    for bad, field in cases:
        with pytest.raises(InvalidRequest) as caught:
            if streamed:
                await collect(client.generate_stream("s", prompt_ids=bad, sampling_params={"max_tokens": 2}))
            else:
                await client.generate("s", prompt_ids=bad, sampling_params={"max_tokens": 2})
        assert caught.value.field == field
    # sampling_params that is no dict: a bare ValueError (dict() of a string) or taken as its pairs
    for bad_params in ("abc", [("max_tokens", 2)]):
        with pytest.raises(InvalidRequest) as caught:
            if streamed:
                await collect(client.generate_stream("s", prompt_ids=[1, 2], sampling_params=bad_params))
            else:
                await client.generate("s", prompt_ids=[1, 2], sampling_params=bad_params)
        assert caught.value.field == "sampling_params"
    assert client.balancer.get_total_inflight() == 0
    # a sequence that is not a list is one still
    _, final, _ = await collect(client.generate_stream("s", prompt_ids=(1, 2), sampling_params={"max_tokens": 2}))
    assert final.token_ids == [100, 101]
