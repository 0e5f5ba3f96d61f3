"""The replica's turns: paused or asleep for the fleet's owner (a colocated learner has the
devices), and the two phases of a weight update (stage while serving, then commit).

Kept apart from :mod:`rollfleet.server.replica`'s data plane because the rules are about who holds
the gate: the owner's pause and resume, and an ``abort``-mode commit's own pause, must not undo
each other. The owner's word wins: paused while a commit loads, the replica stays paused after
it; resumed then, it serves once the weights are in (never on half-loaded ones).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from rollfleet.engines import Engine
from rollfleet.engines.base import CommitMode
from rollfleet.health import ReplicaState

#: States in which requests wait at the replica's gate rather than fail: a pause for a weight
#: update or a sleep is short, and verl's contract is that requests queue on a paused engine.
HOLDING_STATES = (ReplicaState.PAUSED, ReplicaState.SLEEPING)


class ReplicaTurns:
    """Pause, resume, sleep, wake-up and the weight phases of :class:`~rollfleet.server.replica.Replica`
    (its base class). Needs from it: ``engine``, ``_state`` / ``_set_state``, ``_version``, ``_epoch``."""

    engine: Engine
    _state: ReplicaState
    _version: Optional[int]
    _epoch: int

    if TYPE_CHECKING:

        def _set_state(self, state: ReplicaState) -> None: ...

    # Paused or asleep by the fleet's owner (pause/sleep until resume), told from an abort-mode
    # commit's own pause: an owner's pause or resume that lands while a commit loads is kept.
    _owner_hold = False
    _committing = False
    _resumed_in_commit = False
    _resuming = 0  # engine resumes on the wire (a network call on HTTP engines)
    _keep_epoch = 0  # keep-mode commits: requests in flight go on across them, on the new weights

    async def pause(self) -> None:
        """Hold new requests at the gate and abort in-flight ones (they return partial tokens)."""
        self._owner_hold = True
        if self._state == ReplicaState.SERVING:
            self._set_state(ReplicaState.PAUSED)
        await self.engine.pause()

    async def resume(self) -> None:
        """Generate again; an engine put to sleep is woken first (serving asleep would hang). Asked
        while an abort-mode commit loads, the commit resumes when the weights are in."""
        self._owner_hold = False
        if self._committing:
            self._resumed_in_commit = True
            return
        await self._serve()

    async def _serve(self) -> None:
        if self._state == ReplicaState.SLEEPING:
            await self.engine.wake_up()
        self._resuming += 1  # a commit that starts meanwhile resumes the engine after its load
        try:
            await self.engine.resume()
        finally:
            self._resuming -= 1
        if self._owner_hold:  # the owner paused it while the engine resumed (a network call): it stays so
            await self.engine.pause()
            return
        if self._committing:  # an abort-mode commit paused the engine meanwhile: it resumes once loaded
            self._resumed_in_commit = True
            return
        if self._state in HOLDING_STATES:
            self._set_state(ReplicaState.SERVING)

    async def sleep(self) -> None:
        await self.engine.sleep()  # NotSupported propagates before the state changes
        self._owner_hold = True
        if self._state in (ReplicaState.SERVING, ReplicaState.PAUSED):
            self._set_state(ReplicaState.SLEEPING)

    async def wake_up(self) -> None:
        await self.engine.wake_up()
        if self._state == ReplicaState.SLEEPING:
            self._set_state(ReplicaState.PAUSED)

    async def update_weights(self, weights: Any, version: int, *, resume: bool = True) -> dict[str, Any]:
        """Both phases at once, in ``abort`` mode: stage, then commit (see :meth:`commit_weights`)."""
        await self.stage_weights(weights, version)
        return await self.commit_weights(version, "abort", resume=resume)

    async def stage_weights(self, weights: Any, version: int) -> float:
        """Phase 1, while serving: the engine brings ``weights`` (resolved from the object store on
        this node by Ray) to where its commit loads them from. Returns the seconds it took."""
        started = time.monotonic()
        await self.engine.stage_weights(weights, version)
        return time.monotonic() - started

    async def commit_weights(self, version: int, mode: CommitMode = "keep", *, resume: bool = True) -> dict[str, Any]:
        """Phase 2: load the staged ``version``; stamp it only once the weights really loaded.

        ``keep`` (when the engine can; else ``abort``): the engine freezes its in-flight requests
        and continues them on the new weights, the replica keeps serving. ``abort``: hold new
        requests at the gate, abort in-flight ones (they return partial tokens), load, clear the
        prefix cache [, resume, if it was serving before]; a failed load leaves it paused.
        Returns the mode used, ``pause_s`` (the seconds the engine generated nothing) and its
        ``window`` (wall-clock start and end).
        """
        started = time.time()
        # keep only on a replica left to serve: a vLLM keep commit ends by resuming the server's
        # scheduler, which would set generating what a paused one still held while its owner (a
        # colocated learner) had the devices; a paused or asleep one loads as abort does, and stays so.
        serving = not self._owner_hold and self._state not in (ReplicaState.SYNCING, ReplicaState.SLEEPING)
        if mode == "keep" and "keep" in self.engine.update_modes and serving:
            await self.engine.commit_weights(version, "keep")
            self._keep_epoch += 1
            self._set_version(version)
            # The engine's own pause window where it reports one (the call also releases files).
            window = (getattr(self.engine, "last_commit", None) or {}).get("window") or (started, time.time())
            return {"mode": "keep", "pause_s": window[1] - window[0], "window": list(window)}
        # Resumed after if serving (or starting) before, or if the fleet's owner resumed it while it
        # loaded; paused or asleep by the owner (the learner has the devices), it stays so.
        # A resume on the wire counts as serving: its engine call may land before this commit's
        # pause, and the replica would then be marked serving on an engine this commit paused.
        resumes = resume and (self._state in (ReplicaState.SERVING, ReplicaState.SYNCING) or self._resuming > 0)
        if self._state == ReplicaState.SERVING:
            self._set_state(ReplicaState.PAUSED)
        # A load that fails leaves the replica paused: its weights may be half loaded, and it
        # must not generate on them under the old label (the controller fences and restarts it).
        self._committing, self._resumed_in_commit = True, False
        try:
            await self.engine.pause()
            await self.engine.commit_weights(version, "abort")
            await self.engine.clear_kv_cache()
            self._set_version(version)
        finally:
            self._committing = False
        if (resumes or self._resumed_in_commit) and not self._owner_hold and self._state in HOLDING_STATES:
            await self._serve()
        ended = time.time()
        return {"mode": "abort", "pause_s": ended - started, "window": [started, ended]}

    async def weights_checksum(self) -> dict[str, Any]:
        """The version this replica serves and its engine's weight digest (None: cannot tell)."""
        return {"version": self._version, "checksum": await self.engine.weights_checksum()}

    def _set_version(self, version: int) -> None:
        self._version = version
        self._epoch += 1
        if self._state == ReplicaState.SYNCING:
            self._set_state(ReplicaState.PAUSED)  # a restarted replica now has the current weights

    async def set_version(self, version: int) -> None:
        """Stamp a version without loading weights (the weights were placed by other means)."""
        self._set_version(version)


__all__ = ["HOLDING_STATES", "ReplicaTurns"]
