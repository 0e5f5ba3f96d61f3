"""Taking turns on shared devices: the fleet hands them to the learner and gets them back.

Colocated modes (``sync``, ``colocate_async``) train on the devices the replicas generate on. While
the learner trains, the fleet is paused (in-flight requests come back ``aborted`` and wait
client-side) and put to sleep where the engine can free memory; it wakes before new weights load
(vLLM's sleep frees the weights, and an engine loads them awake) and resumes at the end of the
step. An engine that cannot sleep says so once (``NotSupported``) and the fleet then only pauses.
"""

from __future__ import annotations

import logging
from typing import Any

from rollfleet.errors import NotSupported

logger = logging.getLogger(__name__)


class FleetTurns:
    """Where the fleet is in its turn: paused, asleep, or generating."""

    def __init__(self) -> None:
        self.sleep_supported = True
        self.asleep = False
        self.held = False

    async def hand_to_learner(self, manager: Any) -> None:
        # held before the call: a pause that fails (no replica answered) or is cancelled has set
        # the fleet's hold already, and the hand back must resume it (it stayed paused for good)
        self.held = True
        await manager.pause()
        if not self.sleep_supported:
            return
        try:
            await manager.sleep()
            self.asleep = True
        except NotSupported as exc:
            self.sleep_supported = False
            logger.info("fleet cannot sleep (%s): training next to a paused, awake fleet", exc)

    async def wake(self, manager: Any) -> None:
        """Awake, still paused: ready to load weights."""
        if self.asleep:
            await manager.wake_up()
            self.asleep = False

    async def hand_back(self, manager: Any) -> None:
        """Awake and generating again (waking first when no sync came in between)."""
        await self.wake(manager)
        if self.held:
            await manager.resume()
            self.held = False


__all__ = ["FleetTurns"]
