"""A client travels to another process as "a new client of the same fleet, same settings"."""

from __future__ import annotations

import pickle

import pytest

from rollfleet.agent_loop.manager import AgentLoopManager
from rollfleet.agent_loop.worker import AgentLoopWorker
from rollfleet.client import FullyAsyncLLMServerClient, LLMServerClient
from rollfleet.config import RetryConfig, RollfleetConfig, RolloutConfig
from rollfleet.server.local import LocalHandle

pytestmark = pytest.mark.unit


class StandInController:
    """Picklable in place of the controller's Ray handle (the client only stores it here)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StandInController) and other.name == self.name

    __hash__ = None  # type: ignore[assignment]


class Unpicklable:
    """A replica handle that would fail the test if the client tried to ship it."""

    def __reduce__(self):
        raise AssertionError("a client's replica handles must not be pickled")


def rollout_config() -> RolloutConfig:
    return RolloutConfig(response_length=7, retry=RetryConfig(max_attempts=3, initial_backoff_s=0, jitter=0))


def test_fully_async_client_pickles_to_same_class_and_settings_with_fresh_state():
    original = FullyAsyncLLMServerClient(
        rollout_config(),
        servers={"s0": LocalHandle(Unpicklable()), "s1": LocalHandle(Unpicklable())},
        controller=StandInController("fleet-a"),
        partial_rollout=False,
        some_option="kept",
    )
    original.balancer.acquire_server("traj-1")  # a sticky session and an in-flight count
    assert original.balancer.sticky_server("traj-1") is not None

    copy = pickle.loads(pickle.dumps(original))

    assert type(copy) is FullyAsyncLLMServerClient
    assert copy.config == original.config and copy.config.response_length == 7
    assert copy.fleet.controller == StandInController("fleet-a")
    assert copy.partial_rollout is False
    assert copy.init_kwargs == original.init_kwargs == {"partial_rollout": False, "some_option": "kept"}
    assert copy.extra_options == {"some_option": "kept"}
    assert copy.retry.max_attempts == 3
    # Per-process state starts empty: no sessions, no replicas until the controller is asked.
    assert copy.balancer is not original.balancer
    assert copy.balancer.sticky_server("traj-1") is None
    assert copy.get_status()["sticky_sessions"] == 0
    assert copy.balancer.get_all_servers() == {}
    assert copy.fleet is not original.fleet and copy.fleet._task is None


def test_plain_client_pickles_to_plain_class():
    original = LLMServerClient(rollout_config(), controller=StandInController("fleet-b"))
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is LLMServerClient
    assert not hasattr(copy, "partial_rollout")
    assert copy.init_kwargs == {}


def test_client_without_controller_refuses_to_pickle():
    client = FullyAsyncLLMServerClient(rollout_config(), servers={"s0": LocalHandle(Unpicklable())})
    with pytest.raises(TypeError, match="without a controller"):
        pickle.dumps(client)


class StubTokenizer:
    pad_token_id = 0
    eos_token_id = 1


class RecordingClient:
    def __init__(self) -> None:
        self.partial_rollout = True
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_worker_reports_its_client_and_closes_it_only_when_it_owns_it():
    config = RollfleetConfig()
    shared = RecordingClient()
    worker = AgentLoopWorker(config, client=shared, tokenizer=StubTokenizer())
    info = await worker.client_info()
    assert info == {"class": f"{__name__}.RecordingClient", "partial_rollout": True, "owns_client": False}
    await worker.close()
    assert not shared.closed  # a shared client is closed by whoever made it

    given = RecordingClient()
    owner = AgentLoopWorker(config, client=given, tokenizer=StubTokenizer(), owns_client=True)
    assert (await owner.client_info())["owns_client"] is True
    await owner.close()
    assert given.closed


async def test_manager_rejects_client_cls_with_a_ready_client():
    client = LLMServerClient(rollout_config(), controller=StandInController("fleet-c"))
    with pytest.raises(ValueError, match="not both"):
        await AgentLoopManager.create(RollfleetConfig(), llm_client=client, client_cls=FullyAsyncLLMServerClient)
    with pytest.raises(ValueError, match="not both"):
        await AgentLoopManager.create(RollfleetConfig(), llm_client=client, client_kwargs={"partial_rollout": False})
