"""A replica that starts while a weight update lands must still serve the new weights."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.engines import build_engine
from rollfleet.manager.controller import FleetController
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica

pytestmark = pytest.mark.unit


async def test_an_update_during_a_replica_start_up_is_loaded_before_it_serves():
    cfg = RolloutConfig(
        name="sim",
        prompt_length=16,
        response_length=8,
        max_model_len=64,
        sim=SimEngineConfig(vocab_size=300, time_scale=1000.0),
    )
    gate = asyncio.Event()
    started = asyncio.Event()
    replicas: dict[str, Replica] = {}

    def make(replica_id: str, index: int) -> LocalHandle:
        engine = build_engine(cfg, index)
        if index == 1:  # the second replica starts slowly, like a vLLM server
            boot = engine.start

            async def slow_start() -> None:
                started.set()
                await gate.wait()
                await boot()

            engine.start = slow_start
        replicas[replica_id] = Replica(replica_id, cfg, index, engine=engine)
        return LocalHandle(replicas[replica_id])

    controller = FleetController(cfg, replica_factory=make)
    await controller.launch(1)
    adding = asyncio.ensure_future(controller.add_replicas(1))
    await started.wait()
    await controller.update_weights({"step": 1}, 1)  # lands while replica-1 is still starting
    gate.set()
    (info,) = await adding
    assert info.weight_version == 1
    out = await replicas["replica-1"].generate("s", [1, 2, 3], {"max_tokens": 4})
    assert out.extra_fields["global_steps"] == 1 and out.token_versions == [1] * len(out.token_ids)
    snapshot = await controller.snapshot()
    assert set(snapshot.routable_ids()) == {"replica-0", "replica-1"}
    await controller.shutdown()


async def test_a_replica_loading_weights_as_it_joins_does_not_hold_up_the_trainers_update():
    """replica-1 joins and loads the fleet's version 1 (slowly, like a large model); the trainer
    publishes version 2 meanwhile without waiting for that load, and replica-1 then loads 2 as
    well before it serves."""
    cfg = RolloutConfig(
        name="sim", prompt_length=16, response_length=8, max_model_len=64, sim=SimEngineConfig(vocab_size=300)
    )
    loading = asyncio.Event()
    release = asyncio.Event()
    loads: list[int] = []
    replicas: dict[str, Replica] = {}

    def make(replica_id: str, index: int) -> LocalHandle:
        replica = Replica(replica_id, cfg, index, engine=build_engine(cfg, index))
        if index == 1:
            load = replica.update_weights

            async def slow_load(weights: object, version: int) -> object:
                loads.append(version)
                loading.set()
                await release.wait()
                return await load(weights, version)

            replica.update_weights = slow_load  # type: ignore[method-assign]
        replicas[replica_id] = replica
        return LocalHandle(replica)

    controller = FleetController(cfg, replica_factory=make)
    await controller.launch(1)
    await controller.update_weights({"step": 1}, 1)
    adding = asyncio.ensure_future(controller.add_replicas(1))
    await asyncio.wait_for(loading.wait(), 10)
    result = await asyncio.wait_for(controller.update_weights({"step": 2}, 2), 10)  # replica-1 still loading 1
    assert result["replicas"] == 1 and not result["failed"]
    assert not adding.done()
    release.set()
    (info,) = await asyncio.wait_for(adding, 10)
    assert loads == [1, 2] and info.weight_version == 2
    out = await replicas["replica-1"].generate("s", [1, 2, 3], {"max_tokens": 4})
    assert out.extra_fields["global_steps"] == 2 and out.token_versions == [2] * len(out.token_ids)
    assert set((await controller.snapshot()).routable_ids()) == {"replica-0", "replica-1"}
    await controller.shutdown()
