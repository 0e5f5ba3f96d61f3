"""Colocated modes hand the fleet's devices to the learner each step (paused, asleep where the
engine can sleep) and take them back after. A step that fails in between must not leave the fleet
so: whoever keeps or reuses it (a notebook, a retry, another trainer) would find it unable to
serve. The real trainer, client and sim replicas, in virtual time."""

from __future__ import annotations

from typing import Any

import pytest
from trainer_support import sim_train_config

from rollfleet.health import ReplicaState
from rollfleet.plan import VirtualRuntime
from rollfleet.trainer import get_trainer_cls
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_a_learner_step_that_fails_leaves_the_fleet_serving(tmp_path, mode):
    cfg = sim_train_config(tmp_path, mode, {"sim.time_scale": 1.0}, total_steps=4, **{"sim_learner.enabled": True})

    async def go() -> set[Any]:
        trainer = get_trainer_cls(mode)(cfg, runtime=VirtualRuntime())
        try:
            await trainer.init()
            update = trainer.learner.update
            calls = 0

            async def fails_at_step_2(batch: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == 2:
                    states = {r._state for r in trainer.manager.replicas.values()}
                    assert states == {ReplicaState.SLEEPING}  # the learner has the devices
                    raise RuntimeError("out of memory (injected)")
                return await update(batch)

            trainer.learner.update = fails_at_step_2
            with pytest.raises(RuntimeError, match="injected"):
                await trainer.fit()
            return {r._state for r in trainer.manager.replicas.values()}
        finally:
            await trainer.close()

    assert virtual_time.run(go()) == {ReplicaState.SERVING}


async def test_a_pause_that_fails_is_resumed_when_the_fleet_is_handed_back():
    """The fleet's hold is set before its replicas are asked to pause; a pause none of them did
    (every one timed out) raised after it, and the turns, marked held only after a pause that
    returned, never resumed: the fleet stayed on hold, restarted replicas paused again too."""
    from rollfleet.errors import FleetOperationFailed
    from rollfleet.trainer.modes.turns import FleetTurns

    class Manager:
        hold: Any = None

        async def pause(self) -> None:
            self.hold = "paused"
            raise FleetOperationFailed("pause", {"replica-0": "ControlTimeout()"})

        async def resume(self) -> None:
            self.hold = None

        async def wake_up(self) -> None: ...

    manager, turns = Manager(), FleetTurns()
    with pytest.raises(FleetOperationFailed):
        await turns.hand_to_learner(manager)
    await turns.hand_back(manager)
    assert manager.hold is None
