"""Weight updates, fanned out to every live replica (a base of :class:`FleetController`).

They come in two phases (``rollout.weight_sync``):

* **stage**: every replica fetches the weights while the fleet keeps generating. They were put
  in Ray's object store once by the trainer; the controller passes the *reference* on (Ray moves
  the bytes to each node once, where the replica resolves it) and keeps only the reference, to
  bring restarted replicas up to date: its memory does not grow with the model or the syncs.
* **commit**: each engine loads what it staged. ``keep``: in-flight requests are frozen with their
  KV cache and continue on the new weights; ``abort``: they come back ``aborted`` with their
  partial tokens and clients resume them; ``rolling``: replicas commit in waves of
  ``max_unavailable`` of the fleet, so the rest keeps generating throughout.

Every call of an update goes to the actor it staged on: a replica restarted meanwhile is counted
out, not committed to. A replica whose stage or commit fails is marked dead and restarted; it
comes back on the committed version (see the controller's start-up path). The version is
published only after the commit.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Optional

from rollfleet.errors import FleetOperationFailed, InvalidRequest
from rollfleet.health import HealthState, ReplicaRecord
from rollfleet.manager.fanout import ControlFanOut, WeightsRef, caller_mistake
from rollfleet.utils.aio import run_to_end


class WeightUpdates(ControlFanOut):
    """Two-phase weight updates, verified by version and digest, on top of the fan-out."""

    async def update_weights(self, weights: Any, version: int, mode: Optional[str] = None) -> dict[str, Any]:
        """Stage ``weights`` on every live replica, then commit ``version`` (``mode``: the
        configured ``rollout.weight_sync.mode`` unless given). Returns what happened and when:
        ``pause_s`` (the longest a replica generated nothing), ``paused`` (``[start, end]`` wall
        times of each commit wave), ``stage_s``, ``commit_s`` (``verify_s`` of it: the checksum
        round after the commits), ``total_s``, ``modes`` used.

        A caller that gives up (cancelled, timed out, ``ray.cancel``) does not stop the update:
        it runs to its end and publishes. Stopped half-way, replicas would run weights the fleet
        does not know they have (committed, still labelled with the old version), and one
        restarted meanwhile would load the old weights beside them unnoticed. It is bounded by
        the stage and commit timeouts."""
        return await run_to_end(
            self._update_weights(weights, version, mode),
            "a weight update",
            lambda r: f"published version {r['version']}",
        )

    def _wave_size(self, ready: int) -> int:
        """A rolling wave: ``max_unavailable`` of the fleet (draining aside), less the replicas out
        of service already (not ``ready``: dead, restarting, fenced while staging), at least one."""
        members = [r for r in self._records.values() if r.state != HealthState.DRAINING]
        allowance = math.floor(self.config.weight_sync.max_unavailable * len(members))
        return max(1, allowance - (len(members) - ready))

    async def _update_weights(self, weights: Any, version: int, mode: Optional[str]) -> dict[str, Any]:
        if isinstance(weights, WeightsRef):
            weights = weights.ref
        sync = self.config.weight_sync
        mode = mode or sync.mode
        if mode not in ("abort", "keep", "rolling"):
            raise ValueError(f"weight_sync.mode must be abort, keep or rolling, got {mode!r}")
        if isinstance(version, bool) or not isinstance(version, int):  # stamped on every token
            raise InvalidRequest("version", "an integer", version)
        async with self._update_lock:
            if self.current_version is not None and version <= self.current_version:
                raise ValueError(f"weight version must increase: {version} <= current {self.current_version}")
            started = time.monotonic()
            records = self._live()
            fenced: dict[str, str] = {}
            handles = {r.replica_id: r.handle for r in records}  # the actors this update talks to
            staged = await self._gather(records, "stage_weights", weights, version, timeout_s=sync.stage_timeout_s)
            # Weights every replica refuses alike (a bad state dict, a version the engine rejects)
            # are the caller's to fix: nothing is committed, nothing is fenced.
            mistake = caller_mistake(staged)
            if mistake is not None:
                raise mistake
            ready = []
            for r, res in zip(records, staged):
                if isinstance(res, BaseException):
                    self._fence(r, fenced, f"weight staging failed: {res!r}", handles)
                else:
                    ready.append(r)
            stage_done = time.monotonic()
            wave_size = max(1, len(ready)) if mode != "rolling" else self._wave_size(len(ready))
            commit_mode = "abort" if mode == "abort" else "keep"
            paused: list[list[float]] = []
            modes: dict[str, str] = {}
            longest = 0.0
            if mode == "rolling":  # replicas on either version serve meanwhile; new work prefers the new one
                self._rolling_version = version
            try:
                for i in range(0, len(ready), wave_size):
                    # Each replica pauses only for its own commit: one that hangs holds up this
                    # call (up to commit_timeout_s), never the others' generation.
                    wave = self._still_staged(ready[i : i + wave_size], fenced, handles)
                    wave_start = time.time()
                    results = await self._gather(
                        wave, "commit_weights", version, commit_mode, timeout_s=sync.commit_timeout_s
                    )
                    windows = [res["window"] for res in results if isinstance(res, dict) and res.get("window")]
                    # the span in which a replica of this wave was paused (else the whole call)
                    paused.append(
                        [min(w[0] for w in windows), max(w[1] for w in windows)]
                        if windows
                        else [wave_start, time.time()]
                    )
                    for r, res in zip(wave, results):
                        if isinstance(res, BaseException):
                            self._fence(r, fenced, f"weight commit failed: {res!r}", handles)
                        else:
                            if mode == "rolling":  # routable as the new version from its wave on
                                r.weight_version = version
                            modes[r.replica_id] = res["mode"]
                            longest = max(longest, res["pause_s"])
                    if mode == "rolling":
                        self._notify()  # clients route new trajectories to this wave at once
                verify_start = time.monotonic()
                committed = self._still_staged(ready, fenced, handles)
                checksum = await self._verify(committed, fenced, version, handles)
                verify_s = time.monotonic() - verify_start
            finally:
                self._rolling_version = None
            if records and len(fenced) == len(records):
                # No replica took it: the fleet stays on the old version (the fenced replicas come
                # back on it) and the caller learns why from each replica.
                raise FleetOperationFailed("update_weights", fenced)
            # Publish atomically (no await between): every replica that has the new weights is
            # routable under the new version, the others are not. Until now (the checksum round
            # included) the committed replicas stayed routable under the old label, so new work
            # never found the fleet empty; their tokens carry the engine's own version labels.
            for r in committed:
                if r.replica_id not in fenced:
                    r.weight_version = version
            self._checksum = checksum
            self._published_unverified = not records  # no replica to check: the first one back will
            self._weights = weights
            self._has_weights = True
            self.current_version = version
            self._notify()
            done = time.monotonic()
            return {
                "version": version,
                "mode": mode,
                "replicas": len(records),
                "failed": list(fenced),
                "fenced": fenced,
                "modes": modes,
                "waves": len(paused),
                "paused": paused,
                "pause_s": longest,
                "checksum": checksum,
                "stage_s": stage_done - started,
                "commit_s": done - stage_done,
                "verify_s": verify_s,
                "total_s": done - started,
            }

    async def _verify(
        self, committed: list[ReplicaRecord], fenced: dict[str, str], version: int, handles: dict[str, Any]
    ) -> Optional[str]:
        """Every committed replica must report ``version`` and the weight digest more than half of
        them report; one that disagrees never serves on: it is restarted from the reference. With
        no strict majority (two replicas that differ, a three-way split) no digest can be trusted,
        so none is kept: every committed replica is fenced and the update fails."""
        timeout = self.config.health.control_timeout_s
        reports = await self._gather(committed, "weights_checksum", timeout_s=timeout)
        digests = [rep["checksum"] for rep in reports if isinstance(rep, dict) and rep["checksum"] is not None]
        majority: Optional[str] = None
        if digests:
            digest, count = Counter(digests).most_common(1)[0]
            majority = digest if 2 * count > len(digests) else None
        for r, rep in zip(committed, reports):
            if isinstance(rep, BaseException):
                problem = f"weights check failed: {rep!r}"
            elif rep["version"] != version:
                problem = f"reports version {rep['version']} after committing {version}"
            elif rep["checksum"] is not None and majority is None:
                problem = f"weights checksum {rep['checksum']}: no digest is shared by most replicas ({len(digests)})"
            elif rep["checksum"] is not None and rep["checksum"] != majority:
                problem = f"weights checksum {rep['checksum']} differs from the fleet's {majority}"
            else:
                continue
            self._fence(r, fenced, problem, handles)
        return majority

    async def weights_checksums(self) -> dict[str, Optional[str]]:
        """Each live replica's weight digest, as its engine reports it (None: it cannot tell):
        equal on every replica after a verified commit. A replica that cannot answer is fenced."""
        results = await self._fan_out("weights_checksum")
        report = self._settle(results, "weights_checksums")
        return {rid: res["checksum"] for rid, res in results.items() if rid in report["ok"]}

    @staticmethod
    def _still_staged(
        records: list[ReplicaRecord], fenced: dict[str, str], handles: dict[str, Any]
    ) -> list[ReplicaRecord]:
        """Those of ``records`` neither fenced nor restarted since the update staged on them. A
        restarted one is counted out, not called: its new actor staged nothing, and an abort-mode
        commit there paused it on a load that failed, for good (it came back healthy, paused). It
        loads the version this update publishes as it joins."""
        out = []
        for r in records:
            if r.replica_id in fenced:
                continue
            if r.handle is not handles[r.replica_id]:
                fenced[r.replica_id] = "restarted during the update: it loads the published version as it joins"
                continue
            out.append(r)
        return out

    def _fence(self, record: ReplicaRecord, fenced: dict[str, str], detail: str, handles: dict[str, Any]) -> None:
        """Count ``record`` out of this update and, if it is still the actor the update talked to
        and in service, restart it. One the prober already declared dead (its restart under way),
        one being removed (draining) or one already restarted belongs to whoever moved it: failing
        it again would leave a restarted replica dead with no restart pending, or respawn one being
        removed."""
        fenced[record.replica_id] = detail
        if record.handle is handles.get(record.replica_id) and record.state in (
            HealthState.HEALTHY,
            HealthState.SUSPECT,
        ):
            self._fail(record, detail)


__all__ = ["WeightUpdates"]
