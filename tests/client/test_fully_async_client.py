"""FullyAsyncLLMServerClient: budget rules under aborts injected at random points, the same for a stream."""

from __future__ import annotations

import asyncio
import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfleet.client import FullyAsyncLLMServerClient, LLMServerClient
from rollfleet.config import RetryConfig, RolloutConfig
from rollfleet.server.local import LocalHandle
from rollfleet.types import LoadReport, ReplicaResponse, TokenOutput

pytestmark = pytest.mark.unit


class FakeServer:
    """Aborts each attempt after a scripted number of tokens; the weight version rises per attempt."""

    def __init__(
        self, abort_points: list[int], natural_len: int = 10**9, extra: dict | None = None, new_weights: bool = True
    ):
        self.new_weights = new_weights  # False: aborts come from abort_all, the weights never change
        self.abort_points = list(abort_points)
        self.natural_len = natural_len
        self.calls: list[dict] = []
        self.version = 0
        self.extra = extra or {}

    async def generate_with_load(self, request_id, prompt_ids, sampling_params, **kwargs):
        self.calls.append({"prompt_ids": list(prompt_ids), "params": dict(sampling_params), "kwargs": kwargs})
        budget = sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens")
        produced = len(prompt_ids) - len(self.calls[0]["prompt_ids"])
        remaining_natural = self.natural_len - produced
        if self.abort_points:
            n = min(self.abort_points.pop(0), budget)
            reason = "aborted"
            if n >= remaining_natural:
                n, reason = remaining_natural, "stop"
        else:
            n = min(budget, remaining_natural)
            reason = "stop" if n == remaining_natural else "length"
        toks = [(len(prompt_ids) + i) % 97 for i in range(n)]
        v = self.version
        self.version += int(self.new_weights)
        out = TokenOutput(
            token_ids=toks,
            log_probs=[-0.5] * n,
            stop_reason=reason,
            token_versions=[v] * n,
            extra_fields={
                "global_steps": v,
                "min_global_steps": v,
                "max_global_steps": v,
                "attempt_tag": len(self.calls),
                **self.extra,
            },
        )
        return ReplicaResponse(out, LoadReport(replica_id="s0"))


def client(server, response_length=64, max_attempts=1000, cls=FullyAsyncLLMServerClient, handle=LocalHandle, **kw):
    cfg = RolloutConfig(
        response_length=response_length, retry=RetryConfig(max_attempts=max_attempts, initial_backoff_s=0, jitter=0)
    )
    return cls(cfg, servers={"s0": handle(server)}, **kw)


class WholeOnly(LocalHandle):
    """A handle without a data plane (a Ray actor's): a stream gets each attempt's output whole."""

    stream_generate = None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    abort_points=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    budget=st.integers(min_value=1, max_value=80),
    key=st.sampled_from(["max_tokens", "max_new_tokens", None]),
    natural=st.integers(min_value=1, max_value=200),
)
def test_budget_never_exceeded_and_caller_dict_untouched(abort_points, budget, key, natural):
    server = FakeServer(abort_points, natural_len=natural)
    c = client(server, response_length=budget if key is None else 999)
    params = {"temperature": 0.7}
    if key:
        params[key] = budget
    before = copy.deepcopy(params)
    out = asyncio.run(c.generate("req", prompt_ids=[1, 2, 3], sampling_params=params, image_data=None, priority=3))
    assert params == before  # never mutated
    assert len(out.token_ids) <= budget
    assert len(out.log_probs) == len(out.token_ids)
    for call in server.calls:  # each attempt is granted only what is left, under the caller's key
        used_key = key or "max_tokens"
        assert call["params"][used_key] >= 1
        granted_plus_done = call["params"][used_key] + len(call["prompt_ids"]) - 3
        assert granted_plus_done == budget
        # kwargs arrive every attempt, with the id the replica counts this client's requests under
        assert call["kwargs"] == {"image_data": None, "priority": 3, "client_id": c.balancer.client_id}
    if len(out.token_ids) == budget and out.stop_reason != "stop":
        assert out.stop_reason == "length"
    assert out.stop_reason in ("stop", "length")
    # prompt + tokens so far are resent: each attempt's prompt extends the previous one
    for prev, nxt in zip(server.calls, server.calls[1:]):
        assert nxt["prompt_ids"][: len(prev["prompt_ids"])] == prev["prompt_ids"]
    assert out.extra_fields["num_resumes"] == len(server.calls) - 1


def test_versions_and_per_attempt_extra_fields_kept():
    server = FakeServer([5, 5, 0, 5], extra={"spec_num_accepted_tokens": 7})
    out = asyncio.run(client(server).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 30}))
    assert len(out.token_ids) == 30 and out.stop_reason == "length"
    assert out.extra_fields["min_global_steps"] == 0
    assert out.extra_fields["max_global_steps"] == 4
    assert out.extra_fields["global_steps"] == 4
    assert [a["attempt_tag"] for a in out.extra_fields["attempts"]] == [1, 2, 3, 4, 5]
    assert all(a["spec_num_accepted_tokens"] == 7 for a in out.extra_fields["attempts"])
    assert out.token_versions == [0] * 5 + [1] * 5 + [3] * 5 + [4] * 15


def test_all_aborted_until_budget_spent_ends_length():
    server = FakeServer([10, 10, 10, 10])
    out = asyncio.run(client(server).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 40}))
    assert len(out.token_ids) == 40 and out.stop_reason == "length"
    assert len(server.calls) == 4


def test_resumes_that_make_progress_never_run_out_of_attempts():
    """100 aborts (weight updates, one token each in between) with max_attempts=5: the
    generation still gets its whole budget; resumes are not failures."""
    server = FakeServer([1] * 100, new_weights=False)
    out = asyncio.run(client(server, max_attempts=5).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 50}))
    assert len(out.token_ids) == 50 and out.stop_reason == "length"
    assert "resume_exhausted" not in out.extra_fields and out.extra_fields["num_resumes"] == 49


def test_aborts_without_tokens_but_with_new_weights_are_resumed_too():
    """A request aborted before its first token by each of 20 updates in a row is not a failure."""
    server = FakeServer([0] * 20)
    out = asyncio.run(client(server, max_attempts=3).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 8}))
    assert len(out.token_ids) == 8 and out.stop_reason == "length" and len(server.calls) == 21
    assert out.token_versions == [20] * 8


def test_aborts_that_make_no_progress_are_bounded_and_flagged():
    """An abort storm with no token and no weight change: ``max_attempts`` of those in a row, then
    the partial output comes back flagged instead of looping."""
    server = FakeServer([2] + [0] * 100, new_weights=False)
    out = asyncio.run(client(server, max_attempts=5).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 50}))
    assert len(server.calls) == 6  # the one that made progress, then 5 that made none
    assert out.stop_reason == "aborted" and out.extra_fields["resume_exhausted"] is True
    assert len(out.token_ids) == 2


def test_partial_rollout_off_returns_aborted_once_the_weights_changed():
    """The replica serves new weights after the abort (the client's view still says the old ones,
    so the resume is sent): what the new weights sampled is dropped, and the output comes back
    aborted with the old weights' tokens only, never a mix of two policies."""
    server = FakeServer([3])
    out = asyncio.run(
        client(server, partial_rollout=False).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 50})
    )
    assert out.stop_reason == "aborted" and len(out.token_ids) == 3 and out.token_versions == [0, 0, 0]
    assert out.extra_fields["max_global_steps"] == 0 and len(server.calls) == 2


def test_partial_rollout_off_resumes_on_the_same_weights():
    """An abort with no weight change after it (every step of colocate_async pauses the fleet) used
    to throw the response away: the caller regenerated the whole group."""
    server = FakeServer([3, 4], natural_len=20, new_weights=False)
    out = asyncio.run(
        client(server, partial_rollout=False).generate("r", prompt_ids=[1], sampling_params={"max_tokens": 50})
    )
    assert out.stop_reason == "stop" and len(out.token_ids) == 20 and set(out.token_versions) == {0}
    assert len(server.calls) == 3


def test_partial_rollout_off_routes_a_resume_only_to_the_weights_that_sampled_it():
    """The fleet says the replica moved on (its label is 1): the resume is not sent at all."""
    server = FakeServer([3], new_weights=False)
    c = client(server, partial_rollout=False)
    sent = c.balancer.set_version

    def moved_on(server_id, version):
        sent(server_id, 1 if version is not None else None)  # the snapshot's label: newer weights

    c.balancer.set_version = moved_on
    out = asyncio.run(c.generate("r", prompt_ids=[1], sampling_params={"max_tokens": 50}))
    assert out.stop_reason == "aborted" and len(out.token_ids) == 3 and len(server.calls) == 1


def test_no_budget_anywhere_is_a_clear_error():
    server = FakeServer([])
    c = client(server)
    c.config.__dict__["response_length"] = 0  # a config stub without a usable response_length
    with pytest.raises(ValueError, match="budget"):
        asyncio.run(c.generate("r", prompt_ids=[1], sampling_params={}))


def test_same_signature_as_base():
    import inspect

    base = inspect.signature(LLMServerClient.generate)
    sub = inspect.signature(FullyAsyncLLMServerClient.generate)
    assert list(base.parameters) == list(sub.parameters)
    assert "kwargs" in sub.parameters


class SlowServer:
    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled = 0

    async def generate_with_load(self, request_id, prompt_ids, sampling_params, **kwargs):
        self.started.set()
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def test_cancelled_request_releases_its_slot():
    server = SlowServer()
    c = client(server, cls=LLMServerClient)
    task = asyncio.ensure_future(c.generate("r", prompt_ids=[1], sampling_params={"max_tokens": 5}))
    await server.started.wait()
    assert c.balancer.get_total_inflight() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert c.balancer.get_total_inflight() == 0
    assert server.cancelled == 1  # the replica's side was cancelled too


class RefLike:
    """What a Ray actor call returns: awaiting it and being cancelled leaves the call running
    (only ``ray.cancel`` stops it; here ``refs.cancel``, patched)."""

    def __init__(self, call: "asyncio.Task") -> None:
        self.call = call

    def __await__(self):
        return asyncio.shield(self.call).__await__()


class RayActorLike:
    """A replica behind a Ray actor without a data plane: no stream call; calls return refs."""

    stream_generate = None

    def __init__(self, server) -> None:
        self.server = server

    @property
    def generate_with_load(self):
        server = self.server

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                return RefLike(asyncio.ensure_future(server.generate_with_load(*args, **kwargs)))

        return _Method()


async def test_a_cancelled_stream_cancels_the_replicas_call_on_a_handle_without_a_data_plane(monkeypatch):
    """The whole-output call of a Ray actor went on to its end for nobody, its batch slot held."""
    from rollfleet.utils import refs

    monkeypatch.setattr(refs, "cancel", lambda ref: ref.call.cancel())  # as ray.cancel
    server = SlowServer()
    c = client(server, cls=LLMServerClient, handle=RayActorLike)

    async def stream() -> None:
        async for _ in c.generate_stream("r", prompt_ids=[1], sampling_params={"max_tokens": 5}):
            pass

    task = asyncio.ensure_future(stream())
    await server.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert server.cancelled == 1
    assert c.balancer.get_total_inflight() == 0


class SyncingController:
    """A controller whose only replica is still syncing for a while; counts snapshot calls."""

    def __init__(self, server, routable_after_s: float, detail: str = ""):
        self.calls = 0
        self.detail = detail
        self.handle = LocalHandle(server)
        self.ready_at = asyncio.get_running_loop().time() + routable_after_s
        self.snapshot = self  # so that controller.snapshot.remote(...) works like a Ray handle

    def remote(self, known_epoch: int = -1, client_id=None):
        from rollfleet.health import FleetSnapshot

        self.calls += 1
        ready = asyncio.get_running_loop().time() >= self.ready_at
        snap = FleetSnapshot(
            membership_epoch=1,
            current_version=1,
            states={"s0": "healthy" if ready else "syncing"},
            versions={"s0": 1 if ready else None},
            handles={"s0": self.handle} if known_epoch != 1 else None,
            details={"s0": self.detail} if self.detail else {},
        )
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(snap)
        return fut


async def test_requests_waiting_for_a_routable_replica_share_fleet_refreshes():
    """64 requests wait ~0.6 s for a syncing fleet: they back off and share their refreshes
    instead of each asking the controller every 10 ms (thousands of calls)."""
    server = FakeServer([], natural_len=4)
    controller = SyncingController(server, routable_after_s=0.6)
    cfg = RolloutConfig(retry=RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.2, jitter=0))
    c = LLMServerClient(cfg, controller=controller)
    outs = await asyncio.gather(
        *(c.generate(f"w{i}", prompt_ids=[1, 2], sampling_params={"max_tokens": 4}) for i in range(64))
    )
    await c.close()
    assert all(o.stop_reason == "stop" and len(o.token_ids) == 4 for o in outs)
    assert controller.calls < 100, controller.calls


async def test_a_fleet_that_never_becomes_routable_fails_naming_each_replica_and_why():
    """After ``retry.no_server_wait_s`` the request fails, and the error says what each replica is
    doing and why (the controller's own detail), not only that none was routable."""
    from rollfleet.errors import NoServerAvailable, RetriesExhausted

    controller = SyncingController(FakeServer([]), routable_after_s=3600, detail="loading v1 (restart 2)")
    cfg = RolloutConfig(retry=RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.02, no_server_wait_s=0.2))
    c = LLMServerClient(cfg, controller=controller)
    with pytest.raises(RetriesExhausted) as err:
        await c.generate("r", prompt_ids=[1, 2], sampling_params={"max_tokens": 4})
    await c.close()
    cause = err.value.last_error
    assert isinstance(cause, NoServerAvailable)
    assert "retry.no_server_wait_s" in str(cause)
    assert "s0 syncing vNone (loading v1 (restart 2))" in str(cause) and "fleet on v1" in str(cause)
    assert c.balancer.get_total_inflight() == 0


@pytest.mark.parametrize("budget", ["16", True, 0, 2.5])
def test_a_budget_of_the_wrong_type_is_refused_before_any_arithmetic(budget):
    from rollfleet.errors import InvalidRequest

    server = FakeServer([])
    with pytest.raises(InvalidRequest) as err:
        asyncio.run(client(server).generate("r", prompt_ids=[1], sampling_params={"max_tokens": budget}))
    assert err.value.field == "sampling_params.max_tokens" and server.calls == []


def test_the_fleet_view_fails_over_calls_of_a_replica_the_fleet_declares_dead():
    """healthy -> dead (or straight to restarting): the handle drops its connection once, so calls
    in flight there fail over instead of waiting for a hung process to be killed; draining does not."""
    from rollfleet.client.fleet_view import FleetView
    from rollfleet.health import FleetSnapshot
    from rollfleet.routing import GlobalRequestLoadBalancer

    class Handle:
        def __init__(self) -> None:
            self.dropped: list[str] = []

        def drop_connection(self, reason: str) -> None:
            self.dropped.append(reason)

    handles = {"a": Handle(), "b": Handle(), "c": Handle()}
    view = FleetView(GlobalRequestLoadBalancer(servers=dict(handles)))

    def snap(states: dict) -> FleetSnapshot:
        return FleetSnapshot(1, 0, states, {k: 0 for k in states}, details={"a": "probe failed (2x)"})

    view.apply(snap({"a": "healthy", "b": "healthy", "c": "healthy"}))
    view.apply(snap({"a": "dead", "b": "restarting", "c": "draining"}))
    view.apply(snap({"a": "dead", "b": "syncing", "c": "draining"}))
    assert [len(h.dropped) for h in handles.values()] == [1, 1, 0]
    assert "declared dead" in handles["a"].dropped[0] and "probe failed (2x)" in handles["a"].dropped[0]


async def _streamed(c: FullyAsyncLLMServerClient, params: dict) -> TokenOutput:
    async for item in c.generate_stream("r", prompt_ids=[1], sampling_params=params):
        last = item
    assert isinstance(last, TokenOutput)
    return last


@pytest.mark.parametrize(
    "aborts, new_weights, tokens, exhausted",
    [
        ([5, 0, 5, 0, 5, 0, 5], False, 40, False),  # no-progress aborts, never max_attempts in a row
        ([5, 0, 0, 0, 5], True, 40, False),  # aborts that bring no token but new weights
        ([2] + [0] * 100, False, 2, True),  # an abort storm: bounded and flagged
    ],
)
def test_a_stream_resumes_by_the_rule_generate_resumes_by(aborts, new_weights, tokens, exhausted):
    """The stream counted every abort that brought no token against max_attempts, over the whole
    generation and whatever the weights did, and gave up unflagged: 15 and 5 tokens of 40 in the
    first two cases, where generate() returns all 40."""
    params = {"max_tokens": 40}
    outs = []
    for streamed in (False, True):
        server = FakeServer(list(aborts), new_weights=new_weights)
        c = client(server, max_attempts=3, handle=WholeOnly)
        outs.append(
            asyncio.run(_streamed(c, params) if streamed else c.generate("r", prompt_ids=[1], sampling_params=params))
        )
    for out in outs:
        assert len(out.token_ids) == tokens
        assert out.stop_reason == ("aborted" if exhausted else "length")
        assert out.extra_fields.get("resume_exhausted", False) is exhausted
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].extra_fields["num_resumes"] == outs[1].extra_fields["num_resumes"]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_replica_left_on_old_weights_that_aborts_every_attempt_is_bounded_and_flagged(streamed):
    """The fleet is on version 4, the replica still on 0 and aborting each attempt before its
    first token: "the fleet moved past the attempt's weights" counted as progress every time, so
    the generation was resent at once, forever (6,000 attempts in 60 s). It counts once."""
    server = FakeServer([0] * 100, new_weights=False)
    c = client(server, max_attempts=3, handle=WholeOnly)
    c.fleet.current_version = 4  # what the controller's snapshot says
    params = {"max_tokens": 8}
    out = asyncio.run(_streamed(c, params) if streamed else c.generate("r", prompt_ids=[1], sampling_params=params))
    assert len(server.calls) == 4  # the one the move explains, then 3 that made no progress
    assert out.stop_reason == "aborted" and out.extra_fields["resume_exhausted"] is True
