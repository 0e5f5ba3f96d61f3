"""End to end on Ray with the simulated engine: rollouts through weight updates, faults, control ops."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.errors import InvalidRequest
from rollfleet.manager import LLMServerManager

pytestmark = pytest.mark.ray


def fleet_config(**rollout) -> RollfleetConfig:
    base = {
        "name": "sim",
        "num_replicas": 4,
        "prompt_length": 1024,
        "response_length": 256,
        "max_model_len": 4096,
        "routing": {"policy": "least_tokens", "load_refresh_interval_s": 0.1},
        "retry": {"max_attempts": 50, "initial_backoff_s": 0.01, "max_backoff_s": 0.2},
        "health": {"probe_interval_s": 0.2, "probe_timeout_s": 0.5, "failures_to_dead": 2, "busy_grace_s": 2.0},
        "sim": {"vocab_size": 2000, "time_scale": 20.0, "mean_response_tokens": 120, "response_sigma": 0.8},
    }
    base.update(rollout)
    return RollfleetConfig.model_validate({"rollout": base})


@pytest.fixture(scope="module")
async def manager(ray_session):
    m = await LLMServerManager.create(fleet_config())
    yield m
    await m.shutdown()


async def run_trajectory(client, tid: int, turns: int = 3) -> list:
    prompt = [1 + (tid * 7 + j) % 1900 for j in range(40)]
    outs = []
    for _t in range(turns):
        out = await client.generate(
            f"traj-{tid}", prompt_ids=prompt, sampling_params={"temperature": 1.0, "max_tokens": 200}
        )
        outs.append(out)
        prompt = prompt + out.token_ids + [5, 6, 7, 8]  # the "user" replies
    client.finish_session(f"traj-{tid}")
    return outs


async def wait_until(pred, timeout=20.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await pred():
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("mode", ["abort", "keep", "rolling"])
async def test_rollout_survives_weight_updates(manager, mode):
    """abort: interrupted requests come back with their partial tokens and are resumed; keep and
    rolling: nothing is interrupted, and requests that lived through an update carry the exact
    version of every token."""
    client = manager.get_client(FullyAsyncLLMServerClient)
    start_version = (await manager.status()).current_version
    rollout = asyncio.ensure_future(asyncio.gather(*(run_trajectory(client, i) for i in range(200))))
    versions = [start_version]
    for _ in range(3):
        # fire each update while requests are in flight (however fast this machine generates)
        while client.balancer.get_total_inflight() < 20 and not rollout.done():
            await asyncio.sleep(0.005)
        versions.append(versions[-1] + 1)
        result = await manager.update_weights({"step": versions[-1]}, versions[-1], mode)
        assert result["failed"] == [] and result["mode"] == mode
        expected = "abort" if mode == "abort" else "keep"
        assert set(result["modes"].values()) == {expected}
        assert result["waves"] == (2 if mode == "rolling" else 1)  # max_unavailable 0.5 of 4
    trajectories = await rollout
    assert len(trajectories) == 200
    resumed = 0
    for outs in trajectories:
        prev_max = start_version
        for out in outs:
            assert out.stop_reason in ("stop", "length")
            assert len(out.token_ids) <= 200
            lo, hi = out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]
            assert prev_max <= lo <= hi  # monotone within and across turns
            prev_max = hi
            resumed += out.extra_fields["num_resumes"]
            if mode != "abort":  # every token carries its version, in order, within [lo, hi]
                tv = out.token_versions
                assert tv is not None and len(tv) == len(out.token_ids)
                assert tv == sorted(tv) and tv[0] == lo and tv[-1] == hi
    if mode == "abort":
        assert resumed > 0, "the updates should have interrupted some requests"
    else:
        assert resumed == 0, "keep mode continues requests, it never interrupts them"
    assert any(o.extra_fields["min_global_steps"] < o.extra_fields["max_global_steps"] for t in trajectories for o in t)
    assert client.balancer.get_total_inflight() == 0
    assert client.balancer.decisions["version_regressed"] == 0  # no session had to step back a version

    async def replicas_idle():
        stats = await manager.replica_stats()
        return all(s.get("state") == "serving" for s in stats.values()) and all(
            r.inflight == 0 for r in (await manager.status()).replicas.values()
        )

    assert await wait_until(replicas_idle)


async def test_a_rolling_update_serves_throughout_and_new_trajectories_start_on_the_new_version(ray_session):
    """While the second wave loads (2 s), the first is back on the new version: new trajectories go
    there and never wait for the loading replica; every token they get is the new version's."""
    m = await LLMServerManager.create(fleet_config(num_replicas=2, sim={"time_scale": 20.0, "weight_load_ms": 40_000}))
    try:
        client = m.get_client()
        version = (await m.status()).current_version + 1
        update = asyncio.ensure_future(m.update_weights({"step": version}, version, "rolling"))

        async def first_wave_committed():
            await client.fleet.refresh()
            return any(v == version for v in (await m.controller.snapshot.remote()).versions.values())

        assert await wait_until(first_wave_committed, timeout=10.0)
        snapshot = await m.controller.snapshot.remote()
        (updated,) = [rid for rid, v in snapshot.versions.items() if v == version]
        assert sorted(snapshot.routable_ids()) == sorted(snapshot.versions)  # the old version serves too
        outs = await asyncio.gather(
            *(
                client.generate(f"new-{i}", prompt_ids=[3, 4, 5 + i], sampling_params={"max_tokens": 16})
                for i in range(8)
            )
        )
        assert not update.done(), "the second wave should still be loading"
        assert {o.extra_fields["replica_id"] for o in outs} == {updated}
        assert all(o.token_versions is not None and set(o.token_versions) == {version} for o in outs)
        result = await update
        assert result["waves"] == 2 and result["failed"] == [] and result["version"] == version
        assert (await m.controller.snapshot.remote()).preferred_ids() is None
        checksums = await m.weights_checksums()
        assert len(checksums) == 2 and set(checksums.values()) == {result["checksum"]} and result["checksum"]
    finally:
        await m.shutdown()


async def test_a_sync_every_0_3s_never_truncates_a_long_generation(ray_session):
    """Abort-mode updates every 0.3 s (up to 100; at least 50 must land) while 300 long generations
    run, with a retry budget of 5 attempts: every generation still gets its whole budget (resumes
    are not failures)."""
    m = await LLMServerManager.create(
        fleet_config(
            num_replicas=2,
            retry={"max_attempts": 5, "initial_backoff_s": 0.01, "max_backoff_s": 0.2},
            # the default probing: 300 generations on 2 replicas keep a loaded machine's actors busy
            health={"probe_interval_s": 1.0, "probe_timeout_s": 5.0, "failures_to_dead": 3},
            sim={"time_scale": 0.5, "vocab_size": 2000},
        )
    )
    rollout = None
    try:
        client = m.get_client(FullyAsyncLLMServerClient)
        budget = 1200
        rollout = asyncio.ensure_future(
            asyncio.gather(
                *(
                    client.generate(
                        f"long-{i}",
                        prompt_ids=[3, 4, 5 + i],
                        sampling_params={"max_tokens": budget, "ignore_eos": True},
                    )
                    for i in range(300)
                )
            )
        )
        version = (await m.status()).current_version
        syncs = 0
        while syncs < 100 and not rollout.done():
            await asyncio.sleep(0.3)
            version += 1
            result = await m.update_weights({"step": version}, version, "abort")
            assert result["failed"] == []
            syncs += 1
        outs = await rollout
        print(f"{syncs} syncs landed during the generations")
        assert syncs >= 50, f"only {syncs} syncs landed before the generations ended"
        truncated = [o for o in outs if len(o.token_ids) < budget or o.extra_fields.get("resume_exhausted")]
        assert not truncated, [(len(o.token_ids), o.extra_fields["num_resumes"]) for o in truncated[:5]]
        assert all(o.stop_reason == "length" for o in outs)
        assert max(o.extra_fields["num_resumes"] for o in outs) > 5  # more resumes than the retry budget
        assert client.balancer.get_total_inflight() == 0
    finally:
        if rollout is not None and not rollout.done():
            rollout.cancel()  # a failed try must not leave 300 requests waiting in later tests
        await m.shutdown()


async def test_sessions_stick_and_hit_the_prefix_cache(manager):
    client = manager.get_client()
    before = await manager.replica_stats()
    trajectories = await asyncio.gather(*(run_trajectory(client, 1000 + i, turns=4) for i in range(40)))
    for outs in trajectories:
        assert len({o.extra_fields["replica_id"] for o in outs}) == 1
    after = await manager.replica_stats()
    hits = sum(after[r]["prefix_cache_hit_tokens"] - before[r]["prefix_cache_hit_tokens"] for r in after)
    queried = sum(after[r]["prefix_cache_query_tokens"] - before[r]["prefix_cache_query_tokens"] for r in after)
    assert hits / queried > 0.4
    assert client.get_status()["sticky_sessions"] == 0  # finish_session cleared them


async def test_bad_input_is_typed_and_fleet_keeps_serving(manager):
    client = manager.get_client()
    good = [client.generate(f"g{i}", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 8}) for i in range(20)]
    bad = [
        client.generate("b1", prompt_ids=[], sampling_params={}),
        client.generate("b2", prompt_ids=[10**6], sampling_params={}),
        client.generate("b3", prompt_ids=[1] * 5000, sampling_params={}),
        client.generate("b4", prompt_ids=[1], sampling_params={"temperature": -1}),
    ]
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    assert all(not isinstance(r, BaseException) for r in results[:20])
    fields = [r.field for r in results[20:]]
    assert all(isinstance(r, InvalidRequest) for r in results[20:])
    assert fields == ["prompt_ids", "prompt_ids[0]", "prompt_ids", "sampling_params.temperature"]
    assert client.balancer.get_total_inflight() == 0


async def test_cancelled_request_releases_slots_on_both_sides(manager):
    client = manager.get_client()
    task = asyncio.ensure_future(
        client.generate("cancel-me", prompt_ids=[1, 2], sampling_params={"max_tokens": 3000, "ignore_eos": True})
    )
    await asyncio.sleep(0.3)
    assert client.balancer.get_total_inflight() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.balancer.get_total_inflight() == 0

    async def drained():
        return all(r.inflight == 0 for r in (await manager.status()).replicas.values())

    assert await wait_until(drained)


async def test_control_ops_and_membership(manager, tmp_path):
    replicas = await manager.get_replicas()
    assert len(replicas) == 4 and all(r.state == "healthy" for r in replicas)
    assert all(a.startswith("sim://") for a in await manager.get_addresses())
    await manager.clear_kv_cache()
    await manager.start_profile(trace_dir=str(tmp_path))
    client = manager.get_client()
    await client.generate("p", prompt_ids=[1, 2], sampling_params={"max_tokens": 4})
    traces = await manager.stop_profile()
    assert len(traces) == 4 and any(p for p in traces.values())
    await manager.sleep()
    held = asyncio.ensure_future(client.generate("z", prompt_ids=[1, 2], sampling_params={"max_tokens": 4}))
    await asyncio.sleep(0.2)
    assert not held.done()
    await manager.wake_up()
    await manager.resume()
    assert len((await held).token_ids) >= 1
    # add: the new replica gets the current weights before it serves
    added = await manager.add_replicas(1)
    status = await manager.status()
    assert added[0].weight_version == status.current_version
    new_id = added[0].replica_id
    await client.fleet.refresh()
    assert new_id in client.balancer.get_all_servers()
    removed = await manager.remove_replicas([new_id])
    assert removed == [new_id]
    await client.fleet.refresh()
    assert new_id not in client.balancer.get_all_servers()
    result = await manager.abort_all()
    assert result["aborted_count"] == 0


async def test_crashed_replica_loses_no_trajectory_and_rejoins_on_current_weights(manager):
    client = manager.get_client(FullyAsyncLLMServerClient)
    version = (await manager.status()).current_version + 1
    await manager.update_weights({"step": version}, version)
    rollout = asyncio.ensure_future(asyncio.gather(*(run_trajectory(client, 5000 + i, turns=2) for i in range(60))))
    await asyncio.sleep(0.3)
    await manager.inject_fault("replica-2", "crash")
    trajectories = await rollout
    assert all(o.stop_reason in ("stop", "length") for t in trajectories for o in t)

    async def rejoined():
        r = (await manager.status()).replicas["replica-2"]
        return r.state == "healthy" and r.restarts >= 1 and r.weight_version == version

    assert await wait_until(rejoined)
    out = await client.generate("after", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 5})
    assert out.extra_fields["global_steps"] == version


@pytest.mark.parametrize("fault", ["corrupt_load", "crash"])
async def test_replica_failing_a_commit_never_serves_and_returns_on_the_committed_weights(manager, fault):
    """corrupt_load: the replica loads something else (its checksum disagrees with the fleet's);
    crash: its engine dies before the commit. Either way it is taken out at once, restarted from
    the controller's reference, and serves again on the committed version with matching weights."""
    client = manager.get_client(FullyAsyncLLMServerClient)
    version = (await manager.status()).current_version + 1
    await manager.inject_fault("replica-1", fault)
    restarts = (await manager.status()).replicas["replica-1"].restarts
    result = await manager.update_weights({"step": version}, version)
    assert result["checksum"] is not None
    if fault == "corrupt_load" or result["failed"]:  # a crash may be caught by the prober first
        assert result["failed"] == ["replica-1"]
        assert (await manager.status()).replicas["replica-1"].state != "healthy"

    async def rejoined():
        r = (await manager.status()).replicas["replica-1"]
        return r.state == "healthy" and r.restarts > restarts and r.weight_version == version

    assert await wait_until(rejoined)
    stats = await manager.replica_stats()
    assert stats["replica-1"]["weight_version"] == version
    outs = await asyncio.gather(
        *(client.generate(f"v{i}", prompt_ids=[1, 2, i], sampling_params={"max_tokens": 3}) for i in range(20))
    )
    assert {o.extra_fields["global_steps"] for o in outs} == {version}


async def test_hung_replica_is_detected_and_bypassed(ray_session):
    m = await LLMServerManager.create(fleet_config(num_replicas=2))
    try:
        client = m.get_client()
        await m.inject_fault("replica-0", "hang")

        async def dead_or_restarted():
            r = (await m.status()).replicas["replica-0"]
            return r.restarts >= 1 or r.state in ("dead", "restarting", "syncing")

        assert await wait_until(dead_or_restarted, timeout=10)
        outs = await asyncio.gather(
            *(client.generate(f"h{i}", prompt_ids=[1, 2], sampling_params={"max_tokens": 5}) for i in range(20))
        )
        assert len(outs) == 20
    finally:
        await m.shutdown()


async def test_killed_replica_process_drops_its_connections_and_no_trajectory_is_lost(ray_session):
    """The data plane's failure path end to end: a replica's process is killed mid-rollout, its
    clients' connections drop, pending requests come back ReplicaUnavailable and are re-routed."""
    import ray

    from rollfleet.server.direct import DirectHandle

    m = await LLMServerManager.create(fleet_config(num_replicas=2, data_plane_ports=(42000, 42199)))
    try:
        client = m.get_client(FullyAsyncLLMServerClient)
        handles = client.balancer.get_all_servers()
        assert all(isinstance(h, DirectHandle) and h.address for h in handles.values())
        assert all(42000 <= int(h.address.rpartition(":")[2]) <= 42199 for h in handles.values())
        rollout = asyncio.ensure_future(asyncio.gather(*(run_trajectory(client, 9000 + i, turns=2) for i in range(40))))
        await asyncio.sleep(0.4)
        ray.kill(handles["replica-0"].actor, no_restart=True)
        trajectories = await asyncio.wait_for(rollout, 120)
        assert len(trajectories) == 40
        assert all(o.stop_reason in ("stop", "length") for t in trajectories for o in t)
        assert client.balancer.get_total_inflight() == 0

        async def restarted():
            r = (await m.status()).replicas["replica-0"]
            return r.state == "healthy" and r.restarts >= 1

        assert await wait_until(restarted, timeout=60)
        await client.fleet.refresh()
        new = client.balancer.get_all_servers()["replica-0"]
        assert isinstance(new, DirectHandle) and new != handles["replica-0"]
    finally:
        await m.shutdown()


async def test_ray_data_plane_is_still_available(ray_session):
    m = await LLMServerManager.create(fleet_config(num_replicas=2, data_plane="ray"))
    try:
        client = m.get_client()
        assert not any(type(h).__name__ == "DirectHandle" for h in client.balancer.get_all_servers().values())
        trajectories = await asyncio.gather(*(run_trajectory(client, 7000 + i, turns=2) for i in range(10)))
        assert all(len(t) == 2 for t in trajectories)
        with pytest.raises(InvalidRequest) as info:
            await client.generate("bad", prompt_ids=[1, 2], sampling_params={"max_tokens": -1})
        assert info.value.field == "sampling_params.max_tokens"
    finally:
        await m.shutdown()


async def test_clients_learn_of_fleet_changes_at_once_by_watching_the_controller(ray_session):
    """With a 30 s load refresh, a client still sees a new replica and a weight version at once:
    its view is a long poll on the controller that returns on every change."""
    cfg = fleet_config(num_replicas=1)
    cfg.rollout.routing.load_refresh_interval_s = 30.0
    m = await LLMServerManager.create(cfg)
    try:
        client = m.get_client()
        await client.generate("w", prompt_ids=[1, 2], sampling_params={"max_tokens": 2})  # starts the watch
        await asyncio.sleep(0.3)
        added = (await m.add_replicas(1))[0].replica_id

        async def sees_new_replica():
            return added in client.balancer.get_all_servers() and client.balancer.is_routable(added)

        assert await wait_until(sees_new_replica, timeout=5)
        version = (await m.status()).current_version + 1
        await m.update_weights({"step": version}, version)

        async def sees_version():
            return client.fleet.current_version == version

        assert await wait_until(sees_version, timeout=5)
    finally:
        await m.shutdown()
