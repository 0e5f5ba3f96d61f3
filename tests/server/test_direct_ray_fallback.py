"""A data plane the client cannot reach sends requests through Ray: a caller that gives up there
cancels the replica's call too, as on the data plane (awaiting an ObjectRef does not)."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.server.direct import DirectHandle
from rollfleet.types import LoadReport, ReplicaResponse, TokenOutput
from rollfleet.utils.refs import within

pytestmark = pytest.mark.ray


def _slow_replica_cls():
    import ray

    @ray.remote(num_cpus=0)
    class SlowReplica:
        """A replica whose answers take 5 s, and which says how each call ended."""

        def __init__(self) -> None:
            self.ends: dict[str, str] = {}

        async def generate_with_load(self, request_id, prompt_ids, sampling_params=None, **kwargs):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.ends[request_id] = "cancelled"
                raise
            self.ends[request_id] = "finished"
            return ReplicaResponse(TokenOutput(token_ids=[1], log_probs=[0.0]), LoadReport(replica_id="r0"))

        async def ended(self) -> dict[str, str]:
            return self.ends

    return SlowReplica


async def test_a_caller_that_gives_up_on_the_ray_path_cancels_the_replicas_call(ray_session):
    actor = _slow_replica_cls().remote()
    await actor.ended.remote()
    handle = DirectHandle(actor, "127.0.0.1:1", "r0", "token")  # nothing listens there: the Ray path

    with pytest.raises(asyncio.TimeoutError):  # the client's request_timeout_s
        await within(handle.generate_with_load.remote("timed-out", [1], {}), 0.5)

    async def consume() -> None:
        async for _ in handle.stream_generate("streamed", [1], {}):
            pass

    stream = asyncio.ensure_future(consume())
    await asyncio.sleep(0.5)
    stream.cancel()  # the caller left
    with pytest.raises(asyncio.CancelledError):
        await stream
    ends: dict[str, str] = {}
    for _ in range(50):
        ends = await actor.ended.remote()
        if len(ends) == 2:
            break
        await asyncio.sleep(0.1)
    assert ends == {"timed-out": "cancelled", "streamed": "cancelled"}  # not run to their end for nobody
    import ray

    ray.kill(actor)
