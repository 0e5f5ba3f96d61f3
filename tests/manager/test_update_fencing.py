"""Which replicas a weight update fences, and which it leaves to whoever owns them: a caller's
mistake fences none, a replica the prober or a removal already took is not failed a second time,
a checksum vote without a strict majority trusts no digest, an update whose caller gives up
still ends, published, and a client's view of it never goes back to an older snapshot. In-process
sim replicas, no Ray (the helpers of ``test_control_faults``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollfleet.config import WeightSyncConfig
from rollfleet.errors import FleetOperationFailed
from rollfleet.health import HealthState
from rollfleet.types import TokenOutput
from tests.manager.test_control_faults import Faults, config, fleet, serving_on, wait_until

pytestmark = pytest.mark.unit


def _slow_stage_config() -> Any:
    cfg = config()
    sync = WeightSyncConfig(mode="keep", commit_timeout_s=0.5, stage_timeout_s=10.0)
    return cfg.model_copy(update={"weight_sync": sync})


async def test_weights_every_replica_refuses_raise_and_fence_nobody():
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(3)
    for replica in replicas.values():

        async def refuse(weights: Any, version: int) -> float:
            raise ValueError(f"weights must be a state dict, got {type(weights).__name__}")

        replica.engine.stage_weights = refuse  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="state dict"):
        await controller.update_weights(["not", "a", "state", "dict"], 1)
    await asyncio.sleep(0.3)  # a fenced replica would be restarting by now
    status = await controller.status()
    assert {r.state for r in status.replicas.values()} == {HealthState.HEALTHY}
    assert [r.restarts for r in status.replicas.values()] == [0, 0, 0]
    assert controller.current_version in (None, 0)
    await controller.shutdown()


async def test_a_replica_declared_dead_during_the_update_comes_back_on_the_new_weights():
    """The prober restarts a replica hung in staging; the update must not fail it again (it was
    left dead, no restart pending, its new actor serving)."""
    faults = Faults()
    faults.hung_methods = {"stage_weights", "load"}
    controller, _ = fleet(_slow_stage_config(), faults)
    await controller.launch(3)
    faults.hung.add("replica-1")
    old = controller._records["replica-1"].handle

    async def heal() -> None:  # the restarted actor is a healthy one
        while controller._records["replica-1"].handle is old:
            await asyncio.sleep(0.001)
        faults.hung.clear()

    healer = asyncio.ensure_future(heal())
    result = await controller.update_weights({"step": 1}, 1)
    await healer
    assert result["failed"] == ["replica-1"]
    await wait_until(lambda: serving_on(controller, "replica-1", 1), "replica-1 healthy on version 1")
    await controller.shutdown()


async def test_a_replica_removed_during_the_update_drains_and_is_not_restarted():
    faults = Faults()
    faults.hung_methods = {"stage_weights"}
    controller, replicas = fleet(_slow_stage_config(), faults)
    await controller.launch(3)
    faults.hung.add("replica-1")
    draining = replicas["replica-1"]
    await draining.pause()  # a request held at its gate keeps the drain waiting
    request = asyncio.ensure_future(draining.generate("r", [1, 2, 3], {"max_tokens": 4}))
    update = asyncio.ensure_future(controller.update_weights({"step": 1}, 1))
    await asyncio.sleep(0.1)
    removal = asyncio.ensure_future(controller.remove_replicas(["replica-1"], drain_timeout_s=1.5))
    await asyncio.sleep(0.5)
    assert faults.starts["replica-1"] == 1  # no new engine for a replica being removed
    assert not request.done()  # still draining (a restart stopped the old actor at once)
    faults.hung.clear()
    await removal
    result = await update
    assert result["failed"] == ["replica-1"] and faults.starts["replica-1"] == 1
    await asyncio.gather(request, return_exceptions=True)  # cut at the drain's end
    assert "replica-1" not in (await controller.status()).replicas
    await controller.shutdown()


async def test_two_replicas_that_disagree_on_the_digest_fail_the_update():
    """A tie gives no majority: the first replica's digest (here a corrupt one) used to win, the
    good replica was fenced and could never come back (its digest differed from the fleet's)."""
    controller, replicas = fleet(config(), Faults())
    await controller.launch(2)
    engine = replicas["replica-0"].engine
    digest = engine.weights_checksum

    async def corrupt() -> Any:
        return "corrupt-" + str(await digest())

    engine.weights_checksum = corrupt  # type: ignore[method-assign]
    with pytest.raises(FleetOperationFailed, match="no digest is shared by most replicas"):
        await controller.update_weights({"step": 1}, 1)
    assert controller.current_version in (None, 0)
    for rid in ("replica-0", "replica-1"):  # restarted on the old weights
        await wait_until(lambda rid=rid: serving_on(controller, rid, controller.current_version or 0), rid)
    await controller.shutdown()


async def test_the_fleet_stays_routable_while_the_commit_is_verified():
    """After the commit wave the checksum round may wait on one slow replica (up to
    control_timeout_s): the committed replicas were labelled with the new version before it was
    published, so none was routable meanwhile."""
    faults = Faults()
    faults.hung_methods = {"weights_checksum"}
    controller, _ = fleet(config(commit_timeout_s=1.5), faults)
    await controller.launch(3)
    faults.hung.add("replica-2")
    update = asyncio.ensure_future(controller.update_weights({"step": 1}, 1, mode="keep"))
    await asyncio.sleep(0.6)  # committed everywhere; replica-2 hangs in the checksum round
    assert not update.done()
    assert (await controller.snapshot()).routable_ids() == ["replica-0", "replica-1", "replica-2"]
    result = await update
    assert result["failed"] == ["replica-2"]
    assert (await controller.snapshot()).routable_ids() == ["replica-0", "replica-1"]
    await controller.shutdown()


async def test_a_replica_that_hangs_while_it_is_added_fails_in_time_and_updates_go_on():
    """add_replicas had no time limit (only restarts kept health.start_timeout_s), and the start
    loads weights under the update lock: one hung start also held every later update."""
    faults = Faults()
    faults.hung_methods = {"stage_weights"}
    controller, _ = fleet(config(start_timeout_s=1.0), faults)
    await controller.launch(2)
    await controller.update_weights({"step": 1}, 1)
    faults.hung.add("replica-2")  # the replica about to be added hangs while it loads version 1
    with pytest.raises(TimeoutError, match="replica-2: start took over health.start_timeout_s=1s"):
        await asyncio.wait_for(controller.add_replicas(1), 5)
    result = await asyncio.wait_for(controller.update_weights({"step": 2}, 2), 5)
    assert result["failed"] == [] and sorted((await controller.status()).replicas) == ["replica-0", "replica-1"]
    await controller.shutdown()


async def test_an_update_whose_caller_gives_up_mid_commit_still_publishes_what_it_committed():
    """Two replicas have committed when the caller is cancelled; the third is still committing.
    Stopped there, the engines would run version 1 while the fleet published 0 (and kept the old
    weights for any replica restarted meanwhile). The update runs to its end instead."""
    faults = Faults()
    controller, replicas = fleet(config(commit_timeout_s=5.0), faults)
    await controller.launch(3)
    late = replicas["replica-2"]
    commit = late.commit_weights

    async def slow_commit(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.3)
        return await commit(*args, **kwargs)

    late.commit_weights = slow_commit  # type: ignore[method-assign]
    update = asyncio.ensure_future(controller.update_weights({"step": 1}, 1))
    await asyncio.sleep(0.1)
    assert not update.done()
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    await wait_until(lambda: _published(controller, 1), "version 1 published after the caller gave up")
    assert controller._weights == {"step": 1}  # what a restarted replica would load
    snapshot = await controller.snapshot()
    assert snapshot.versions == {rid: 1 for rid in replicas}
    for rid, replica in replicas.items():
        out = await replica.generate(f"after-{rid}", [1, 2, 3], {"max_tokens": 2})
        assert out.token_versions == [1] * len(out.token_ids), rid
    await controller.shutdown()


async def _published(controller: Any, version: int) -> bool:
    return controller.current_version == version


async def test_a_clients_view_never_goes_back_to_a_snapshot_older_than_it_has():
    """A refresh answered late (taken before an update) arrives after the watch's newer snapshot.
    Applied, it looked like a rollback: the view went back to version 0 and every session's
    version floor was cleared, so a session's next turn could land on old weights."""
    from rollfleet.client.fleet_view import FleetView
    from rollfleet.routing import GlobalRequestLoadBalancer

    controller, _ = fleet(config(), Faults())
    await controller.launch(2)
    before = await controller.snapshot()
    await controller.update_weights({"step": 1}, 1)
    after = await controller.snapshot()
    assert after.seq[1] > before.seq[1]
    lb = GlobalRequestLoadBalancer({})
    view = FleetView(lb)
    view.apply(after)
    sid, _ = lb.acquire_server("traj")
    lb.observe_output(sid, "traj", TokenOutput(token_ids=[1], extra_fields={"global_steps": 1}))
    lb.release_server(sid)
    view.apply(before)  # the late answer
    assert view.current_version == 1 and lb._floors.get("traj") == 1
    assert set(lb.get_all_servers()) == {"replica-0", "replica-1"}
    # a newer snapshot, and one from a restarted controller (its own count), are applied
    await controller.update_weights({"step": 2}, 2)
    view.apply(await controller.snapshot())
    assert view.current_version == 2
    other, _ = fleet(config(), Faults())
    await other.launch(2)
    view.apply(await other.snapshot())
    assert view.current_version == 0
    await controller.shutdown()
    await other.shutdown()


async def test_an_update_with_no_replica_live_is_loaded_and_checked_as_they_come_back():
    """Every replica restarting (a node lost): the update is published, each one loads it before
    it serves, and the first one back gives the digest the next is checked against (there was
    none until the next update: a joiner with other weights was let in unchecked)."""
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    faults.failed_starts = {"replica-0": 10**6, "replica-1": 10**6}  # no start succeeds yet
    faults.dead.update({"replica-0", "replica-1"})
    await wait_until(lambda: _none_live(controller), "both replicas down")
    result = await controller.update_weights({"step": 1}, 1)
    assert result["replicas"] == 0 and controller._checksum is None
    faults.dead.clear()
    faults.failed_starts["replica-0"] = 0  # replica-0 comes back first, on version 1
    await wait_until(lambda: serving_on(controller, "replica-0", 1), "replica-0 back on version 1")
    assert controller._checksum == (await replicas["replica-0"].weights_checksum())["checksum"] is not None
    faults.failed_starts["replica-1"] = 0
    await wait_until(lambda: serving_on(controller, "replica-1", 1), "replica-1 back on version 1, the same digest")
    await controller.shutdown()


async def _none_live(controller: Any) -> bool:
    return not controller._live()


async def test_a_replica_restarted_between_stage_and_commit_is_not_committed_to_and_serves():
    """replica-2 staged, then died while replica-0 still staged; its restart's new actor was up
    when the abort-mode commit wave went out, and got it: a commit of nothing staged paused it
    for good, yet it joined healthy and routable, and every request routed there hung."""
    cfg = config().model_copy(update={"weight_sync": WeightSyncConfig(mode="abort", commit_timeout_s=2.0)})
    faults = Faults()
    controller, replicas = fleet(cfg, faults)
    await controller.launch(3)
    old = replicas["replica-2"]
    stage_slowly, stage_then_die = replicas["replica-0"].stage_weights, old.stage_weights

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(1.0)  # a big state dict on a slow node
        return await stage_slowly(*args, **kwargs)

    async def dies(*args: Any, **kwargs: Any) -> Any:
        staged = await stage_then_die(*args, **kwargs)
        faults.dead_actors.append(old)  # the prober notices and restarts it
        return staged

    replicas["replica-0"].stage_weights = slow  # type: ignore[method-assign]
    old.stage_weights = dies  # type: ignore[method-assign]
    result = await controller.update_weights({"step": 1}, 1)
    assert "restarted during the update" in result["fenced"]["replica-2"]
    await wait_until(lambda: serving_on(controller, "replica-2", 1), "replica-2 routable on version 1")
    new = replicas["replica-2"]
    assert new is not old and new._state.value == "serving" and new._version == 1
    out = await asyncio.wait_for(new.generate("after", [1, 2, 3], {"max_tokens": 4}), 5)
    assert len(out.token_ids) >= 1
    await controller.shutdown()


async def test_replicas_are_added_after_the_launch_that_versions_the_boot_weights():
    """Added before launch() (no current version), a replica booted syncing, skipped its catch-up
    and was marked healthy: routable, and refusing every request ('state is syncing')."""
    from rollfleet.errors import InvalidRequest

    controller, replicas = fleet(config(1.0), Faults())
    with pytest.raises(InvalidRequest, match="after launch"):
        await controller.add_replicas(1)
    assert controller._records == {}
    await controller.launch(1, initial_version=5)  # what launch says still holds
    (info,) = await controller.add_replicas(1)
    assert info.weight_version == 5
    out = await asyncio.wait_for(replicas[info.replica_id].generate("x", [1, 2, 3], {"max_tokens": 4}), 5)
    assert len(out.token_ids) >= 1
    await controller.shutdown()
