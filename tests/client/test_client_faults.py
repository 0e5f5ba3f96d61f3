"""Failures around a request rather than in it: a replica that comes back from quarantine, the last
replica removed, and a shared balancer actor (verl's deployment) whose calls are cancelled or
fail. Each may cost time; none may lose a result, regenerate a finished one or leak a count."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayActorError

from rollfleet.client import LLMServerClient
from rollfleet.config import RolloutConfig
from rollfleet.errors import ReplicaUnavailable, RetriesExhausted
from rollfleet.routing import GlobalRequestLoadBalancer
from rollfleet.server.local import LocalHandle
from rollfleet.types import LoadReport, ReplicaResponse, TokenOutput
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit

PARAMS = {"max_tokens": 8}


class Server:
    """Answers after ``duration`` seconds (virtual or real); fails its first ``failures`` calls."""

    def __init__(self, name: str, duration: float = 1.0, failures: int = 0) -> None:
        self.name, self.duration, self.failures, self.calls = name, duration, failures, 0

    async def generate_with_load(self, request_id: str, prompt_ids: list[int], params: Any, **kwargs: Any):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise ReplicaUnavailable(self.name, "crashed")
        await asyncio.sleep(self.duration)
        out = TokenOutput(token_ids=[7], log_probs=[-0.1], extra_fields={"global_steps": 0})
        return ReplicaResponse(out, LoadReport(replica_id=self.name, timestamp=virtual_time.now()))


def held_client(servers: dict[str, Server]) -> LLMServerClient:
    """One request per replica at a time (late binding); no controller, as in a plan or a tool."""
    config = RolloutConfig(
        response_length=8,
        retry={"initial_backoff_s": 0.1, "jitter": 0.0},
        routing={"policy": "least_inflight", "max_inflight_per_replica": 1},
    )
    return LLMServerClient(config, servers={n: LocalHandle(s) for n, s in servers.items()})


def test_a_replica_back_from_quarantine_takes_the_request_held_for_room():
    async def main() -> tuple[float, float, float]:
        a, b = Server("A", 1.0, failures=1), Server("B", 100.0)
        client = held_client({"A": a, "B": b})
        start = virtual_time.now()
        first = asyncio.ensure_future(client.generate("first", prompt_ids=[1], sampling_params=PARAMS))
        await asyncio.sleep(0)  # it takes A, which crashes: A is quarantined
        slow = asyncio.ensure_future(client.generate("slow", prompt_ids=[2], sampling_params=PARAMS))
        await asyncio.sleep(0.5)  # first's retry, a request placed before, is not held: it goes to B
        assert b.calls == 2
        held = asyncio.ensure_future(client.generate("new", prompt_ids=[3], sampling_params=PARAMS))
        done_held = (await held, virtual_time.now() - start)[1]  # a new placement: held for room
        done_first = (await first, virtual_time.now() - start)[1]
        await slow
        assert client.balancer.get_total_inflight() == 0 and a.calls == 2
        return done_held, done_first, client.fleet.quarantine_s

    done_held, done_first, quarantine_s = virtual_time.run(main())
    # back when its quarantine ends, not when B's 100 s request frees B
    assert done_held == pytest.approx(quarantine_s + 1.0, abs=0.2)
    assert done_first == pytest.approx(100.0, abs=0.5)


def test_a_request_held_for_room_fails_over_when_the_last_replica_is_removed():
    async def main() -> tuple[float, Any]:
        client = held_client({"A": Server("A", 1.0)})
        running = asyncio.ensure_future(client.generate("running", prompt_ids=[1], sampling_params=PARAMS))
        await asyncio.sleep(0)
        held = asyncio.ensure_future(client.generate("held", prompt_ids=[2], sampling_params=PARAMS))
        await asyncio.sleep(0.1)
        assert client._gate is not None and client._gate.waiting == 1
        start = virtual_time.now()
        client.balancer.remove_servers(["A"])
        await running
        error = (await asyncio.gather(held, return_exceptions=True))[0]
        assert client.balancer.get_total_inflight() == 0
        return virtual_time.now() - start, error

    waited, error = virtual_time.run(main())
    assert isinstance(error, RetriesExhausted) and "no_server_wait_s" in str(error)
    assert waited == pytest.approx(RolloutConfig().retry.no_server_wait_s, rel=0.05)


class ActorLike:
    """Calls a target as a Ray actor handle does: ``.remote()`` submits the call, which runs to
    the end after a network delay whether or not its caller still waits for the answer."""

    def __init__(self, target: Any, delay: float = 0.01) -> None:
        self.target, self.delay = target, delay

    def __getattr__(self, name: str) -> Any:
        method, delay = getattr(self.target, name), self.delay

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                async def call() -> Any:
                    await asyncio.sleep(delay)
                    result = method(*args, **kwargs)
                    return await result if asyncio.iscoroutine(result) else result

                return asyncio.shield(asyncio.get_running_loop().create_task(call()))

        return _Method()


async def test_a_caller_cancelled_while_the_shared_balancer_picks_leaks_no_count():
    shared = GlobalRequestLoadBalancer({"s0": LocalHandle(Server("s0", 1.0))})
    client = LLMServerClient(RolloutConfig(response_length=8), load_balancer_handle=ActorLike(shared, delay=0.05))
    call = asyncio.ensure_future(client.generate("r", prompt_ids=[1], sampling_params=PARAMS))
    await asyncio.sleep(0.01)  # the acquire is on its way
    call.cancel()
    await asyncio.sleep(0.2)  # the actor counted it, then heard the release
    assert call.cancelled()
    assert shared.get_total_inflight() == 0


class FailingRelease:
    """A shared balancer actor whose first release fails (the actor died and was restarted)."""

    def __init__(self, server: Server) -> None:
        self.server, self.releases = LocalHandle(server), 0

    def acquire_server(self, request_id: str) -> tuple[str, Any]:
        return "s0", self.server

    def release_server(self, server_id: str) -> None:
        self.releases += 1
        if self.releases == 1:
            raise RayActorError()


async def test_a_failed_release_on_the_shared_balancer_keeps_the_result_and_regenerates_nothing():
    server = Server("s0", 0.01)
    balancer = FailingRelease(server)
    config = RolloutConfig(response_length=8, retry={"initial_backoff_s": 0.0, "jitter": 0.0})
    client = LLMServerClient(config, load_balancer_handle=ActorLike(balancer, delay=0.0))
    out = await client.generate("r", prompt_ids=[1], sampling_params=PARAMS)
    assert out.token_ids == [7] and out.stop_reason == "stop"
    assert server.calls == 1 and balancer.releases == 1


def test_a_controller_down_at_the_first_request_leaves_the_client_routing_on_the_view_it_has():
    """The first snapshot's error (a controller restarting) escaped every request as the raw
    ConnectionError; later refreshes that fail already keep routing on the last view."""

    class Down:
        async def _fail(self, *args: Any, **kwargs: Any) -> None:
            raise ConnectionError("controller restarting")

        def remote(self, *args: Any, **kwargs: Any) -> Any:
            return asyncio.ensure_future(self._fail())

    class Controller:
        snapshot = Down()

    async def main() -> TokenOutput:
        client = held_client({"A": Server("A", 1.0)})
        client.fleet.controller = Controller()
        out = await client.generate("r", prompt_ids=[1], sampling_params=PARAMS)
        assert client.balancer.get_total_inflight() == 0
        return out

    assert virtual_time.run(main()).token_ids == [7]
