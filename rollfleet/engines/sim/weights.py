"""Weight loads of the sim engine (a base of :class:`~rollfleet.engines.sim.SimEngine`).

A load takes ``weight_load_ms`` of simulated time; the tokens sampled after it come from the new
weights' stream, and every request salts its block hashes with the weights it arrived under, as
rollfleet's vLLM engine salts each request with the weights' label: no request hits blocks other
weights computed. Salts are handed out once each: a load takes a new one when it starts, and a load
that fails or is cancelled never gives its salt to other weights (the requests that arrived during
it hold it, and ran on the weights before).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from rollfleet.engines.base import CommitMode
from rollfleet.engines.sim.steps import StepLoop
from rollfleet.engines.sim.tokens import _fingerprint, _mix
from rollfleet.errors import NotSupported


class WeightLoads(StepLoop):
    """Loads and two-phase commits; the state is the engine's (set in its ``__init__``)."""

    name: ClassVar[str]
    update_modes: ClassVar[frozenset[str]]
    _num_updates: int
    #: The salt of the loaded weights' block hashes (0: the boot weights), that of the load in
    #: progress, and how many were handed out.
    _salt: int
    _loading_salt: int
    _salts_taken: int
    _weights_fp: int
    _weights_seed: int
    _corrupt_next_load: bool
    _version_label: Optional[int]

    if TYPE_CHECKING:

        def _check_alive(self) -> None: ...

    async def update_weights(self, weights: Any) -> None:
        await self._load(weights, clear_cache=True)

    async def _load(self, weights: Any, clear_cache: bool, salt: Optional[int] = None) -> None:
        """Load ``weights``. Requests that arrive from now on salt their block hashes with them, as
        rollfleet's vLLM engine salts each request with the weights' label: none hits a block
        computed by other weights, whether or not the cache is cleared (``clear_cache``: a reset,
        after which not even the requests already queued find their old blocks)."""
        self._check_alive()
        self._catch_up()
        self._materialize_all()  # the tokens counted so far came from the weights before these
        self._num_updates += 1
        if salt is None:
            self._salts_taken += 1
            salt = self._salts_taken
        self._salt = salt
        self._weights_fp = _fingerprint(weights)
        if self._corrupt_next_load:
            self._corrupt_next_load = False
            self._weights_fp = _mix(self._weights_fp, 0xBAD)
        self._weights_seed = _mix(self.config.seed, self._weights_fp, self._num_updates)
        for req in self._requests.values():  # in flight: the rest comes from the new weights
            req.token_seed = _mix(self._weights_seed, *req.sample_key)
        if clear_cache:
            self._prefix_cache.clear()

    async def commit_weights(self, version: int, mode: CommitMode = "abort") -> None:
        """As a real engine: ``abort`` loads on a paused engine; ``keep`` stops stepping (the
        running requests keep their KV), loads, and lets them continue on the new weights (their
        next tokens come from the new weights' stream). Either way the load takes
        ``weight_load_ms`` of simulated time, and tokens are labelled ``version`` from now on."""
        if mode not in self.update_modes:
            raise NotSupported(self.name, f"commit_weights(mode={mode!r})", f"modes: {sorted(self.update_modes)}")
        staged = self.__dict__.get("_staged_weights", {})
        if version not in staged:
            raise KeyError(f"no weights staged under version {version} (staged: {sorted(staged)})")
        weights = staged[version]  # taken now: weights staged during the load are the next commit's
        self._catch_up()
        self._materialize_all()
        self._salts_taken += 1
        self._loading_salt = self._salts_taken
        salt = self._loading_salt
        self._loading += 1  # the step loop emits nothing until the load is done (a pause or resume
        try:  # meanwhile is the operator's: it holds after the load)
            if self.config.weight_load_ms:
                await asyncio.sleep(self.config.weight_load_ms / 1000.0 / self.config.time_scale)
            # keep: the running requests hold their blocks (computed by the old weights, as in
            # vLLM, whose prefix cache cannot be reset while blocks are in use); the new salt keeps
            # every later request off them. abort: the replica resets the cache after the load.
            await self._load(weights, clear_cache=mode != "keep", salt=salt)
            if staged.get(version) is weights:
                del staged[version]
            self._version_label = version
        finally:
            self._loading -= 1
            if self._work is not None:
                self._work.set()

    async def weights_checksum(self) -> Optional[str]:
        """The fingerprint of the weights last loaded: equal on replicas that loaded the same ones."""
        return f"{self._weights_fp:016x}"

    async def clear_kv_cache(self) -> None:
        self._prefix_cache.clear()


__all__ = ["WeightLoads"]
