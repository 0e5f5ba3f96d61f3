"""SimEngine: the simulated engine's :class:`~rollfleet.engines.base.Engine` face.

The data plane, the control ops (pause, sleep, profile) and the fault hooks for tests live here;
weight loads are :mod:`.weights`, the step loop :mod:`.steps`, the batching model :mod:`.batch`.
Every op that reads or changes the batch first settles the steps a fast-forward has finished by
then (:meth:`~rollfleet.engines.sim.steps.StepLoop._catch_up`). See the package docstring for the
model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import tempfile
import time
from collections import deque
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.engines.base import Engine, EngineHealth, EngineLimits, EngineLoad
from rollfleet.engines.sim.batch import _Request
from rollfleet.engines.sim.continuations import Continuations
from rollfleet.engines.sim.cost import StepCost
from rollfleet.engines.sim.prefix import PrefixCache
from rollfleet.engines.sim.steps import _Run
from rollfleet.engines.sim.tokens import _mix
from rollfleet.engines.sim.weights import WeightLoads
from rollfleet.errors import EngineDead, InvalidRequest
from rollfleet.types import SamplingParams, TokenDelta, TokenOutput

#: A script maps (request_id, prompt_ids, sampling_params) to the exact response tokens. The
#: response ends with ``stop`` after those tokens unless ``max_tokens`` cuts it first.
ResponseScript = Callable[[str, list[int], SamplingParams], Sequence[int]]

logger = logging.getLogger(__name__)


class SimEngine(WeightLoads, Engine):
    """Simulated continuous-batching engine; see the package docstring for the model."""

    name = "sim"
    update_modes = frozenset({"abort", "keep"})
    streams = True
    profile_options = frozenset({"trace_dir"})

    def __init__(self, config: SimEngineConfig, *, max_model_len: Optional[int] = None, replica_index: int = 0):
        self.config = config
        self._cost = StepCost.of(config)
        self.replica_index = replica_index
        self._max_model_len = max_model_len or config.max_model_len
        self._kv_blocks_total = max(1, config.kv_capacity_tokens // config.block_size)
        self._kv_blocks_free = self._kv_blocks_total
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._prefix_cache = PrefixCache(config.prefix_cache_blocks)
        self._weights_seed = _mix(config.seed, 0)
        self._num_updates = 0
        self._salt = self._loading_salt = self._salts_taken = 0  # see WeightLoads
        self._weights_fp = 0  # the fingerprint of the weights last loaded (0: the boot weights)
        self._corrupt_next_load = False
        self._version_label: Optional[int] = None
        self._admit_counter = 0
        self._unpaid: dict[_Request, int] = {}  # prefill tokens of admitted requests no step has paid yet
        self._left_in_prefill: list[_Request] = []  # left during their prefill's step: see BatchModel._leave
        self._paused = False
        self._loading = 0  # weight loads in progress (commit_weights)
        self._sleeping = False
        self._started = False
        self._dead: Optional[str] = None
        self._hung = False
        self._slow_factor = 1.0
        self._work = asyncio.Event() if _has_loop() else None
        self._loop_task: Optional[asyncio.Task[None]] = None
        self._script: Optional[ResponseScript] = None
        self._rng = random.Random(_mix(config.seed, replica_index, 17))
        self._continuations = Continuations()  # what aborted responses had left (see .continuations)
        self._profile: Optional[list[dict[str, Any]]] = None
        self._profile_dir: Optional[str] = None
        self._sim_clock = 0.0
        self._run_now: Optional[_Run] = None  # the steps the loop sleeps through
        self._wake_at: Optional[tuple[asyncio.Future[None], asyncio.TimerHandle]] = None
        self._stats = {
            "prefix_cache_query_tokens": 0,
            "prefix_cache_hit_tokens": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "num_preemptions": 0,
            "num_aborted": 0,
            "num_finished": 0,
            "num_steps": 0,
            "num_wakes": 0,  # of the step loop: fewer than steps where it fast-forwards
            "sim_busy_s": 0.0,
        }

    @classmethod
    def from_config(cls, config: RolloutConfig, replica_index: int) -> "SimEngine":
        sim = config.sim
        if config.max_model_len and config.max_model_len != sim.max_model_len:
            sim = sim.model_copy(update={"max_model_len": config.max_model_len})
        sim.check_holds_a_sequence(sim.max_model_len)  # a replica's start fails, as vLLM's does
        return cls(sim, max_model_len=sim.max_model_len, replica_index=replica_index)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started:
            return
        self._work = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-{self.replica_index}")
        self._started = True

    async def shutdown(self) -> None:
        if self._started:  # the steps a fast-forward finished by now count, as one at a time they did
            try:
                self._catch_up()
            except Exception:  # counting is not worth a shutdown that leaves its loop running
                logger.exception("sim-%d: settling the last steps at shutdown failed", self.replica_index)
        self._fail_all(EngineDead(f"sim-{self.replica_index}", "engine shut down"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        self._left_in_prefill.clear()  # their prefill's step never ends: nothing of theirs is cached
        self._started = False

    def limits(self) -> EngineLimits:
        return EngineLimits(vocab_size=self.config.vocab_size, max_model_len=self._max_model_len)

    def address(self) -> str:
        return f"sim://replica-{self.replica_index}"

    # ------------------------------------------------------------------ data plane
    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        req = await self._submit(request_id, prompt_ids, sampling_params)
        if isinstance(req, TokenOutput):
            return req
        try:
            out = await asyncio.shield(req.future)
        except asyncio.CancelledError:
            # The caller gave up: free the engine's resources, never leak a running sequence.
            self._catch_up()
            self._finish(req, "aborted")
            raise
        await self._deliver()
        return self._with_extras(out, kwargs)

    async def _deliver(self) -> None:
        """The way back to the caller (``request_overhead_ms``): the engine has freed the slot."""
        if self.config.request_overhead_ms:
            await asyncio.sleep(self.config.request_overhead_ms / 1000.0 / self.config.time_scale)

    async def generate_stream(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
        req = await self._submit(request_id, prompt_ids, sampling_params, streamed=True)
        if isinstance(req, TokenOutput):
            yield req
            return
        assert req.progress is not None
        sent = 0
        try:
            while not req.future.done():
                await req.progress.wait()
                req.progress.clear()
                n = len(req.generated)
                if n > sent and not req.future.done():
                    yield TokenDelta(req.generated[sent:n], req.log_probs[sent:n], req.versions[sent:n])
                    sent = n
        except BaseException:  # cancelled, or the consumer closed the stream: stop generating
            self._catch_up()
            self._finish(req, "aborted")
            raise
        out = req.future.result()
        await self._deliver()
        if len(out.token_ids) > sent:  # sampled in the step that ended it
            yield TokenDelta(out.token_ids[sent:], (out.log_probs or [])[sent:], (out.token_versions or [])[sent:])
        yield self._with_extras(out, kwargs)

    async def _submit(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, streamed: bool = False
    ) -> Union[_Request, TokenOutput]:
        """Queue a request (or answer at once: a script's empty response)."""
        self._check_alive()
        if not self._started:
            await self.start()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight on this engine")
        max_tokens = int(sampling_params["max_tokens"])
        # A replica validates requests fully (rollfleet.server.validation); these are the limits the
        # engine's own arithmetic rests on, for those that call it directly (calibration, tests).
        if max_tokens < 1:
            raise InvalidRequest("sampling_params.max_tokens", "max_tokens >= 1", max_tokens)
        if not 0 < len(prompt_ids) < self._max_model_len:
            raise InvalidRequest("prompt_ids", f"1 <= length < max_model_len ({self._max_model_len})", len(prompt_ids))
        if float(sampling_params.get("temperature", 1.0)) < 0:
            raise InvalidRequest("sampling_params.temperature", "temperature >= 0", sampling_params["temperature"])
        req = _Request(request_id, list(prompt_ids), max_tokens)
        # the weights it runs under (see _load): arriving during a load, those being loaded
        req.cache_salt = self._loading_salt if self._loading else self._salt
        req.stop_ids = frozenset(sampling_params.get("stop_token_ids") or ())
        req.ignore_eos = bool(sampling_params.get("ignore_eos", False))
        req.min_tokens = int(sampling_params.get("min_tokens") or sampling_params.get("min_new_tokens") or 0)
        prompt_key, salt = self._seed_request(req, sampling_params)
        if self._script is not None:
            req.scripted = [int(t) for t in self._script(request_id, list(prompt_ids), dict(sampling_params))]
            req.target_len = len(req.scripted)
            if not req.scripted:  # the script says nothing: an empty response that stopped
                return TokenOutput(token_ids=[], log_probs=[], stop_reason="stop")
        else:
            continued = self._continuations.take(prompt_key, len(req.prompt_ids))
            req.target_len = continued if continued is not None else self._natural_length(prompt_key, salt)
            # its EOS comes no sooner than min_tokens allow: as vLLM masks it out until then
            req.target_len = max(req.target_len, req.min_tokens + 1)
        req.end_at = self._latest_end(req)
        if streamed:
            req.progress = asyncio.Event()
        self._catch_up()  # it joins the batch at the next step's start
        self._requests[request_id] = req
        self._waiting.append(req)
        assert self._work is not None
        self._work.set()
        return req

    @staticmethod
    def _with_extras(out: TokenOutput, kwargs: dict[str, Any]) -> TokenOutput:
        extras = {k: v for k, v in kwargs.items() if v is not None}
        if extras:  # echoed so tests can see what reached the engine
            out.extra_fields["request_kwargs"] = extras
        return out

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._catch_up()
            self._finish(req, "aborted")

    async def abort_all(self) -> int:
        self._catch_up()
        reqs = list(self._requests.values())
        for req in reqs:
            self._finish(req, "aborted")
        return len(reqs)

    async def pause(self) -> None:
        self._paused = True
        await self.abort_all()

    async def resume(self) -> None:
        self._paused = False
        if self._work is not None:
            self._work.set()

    async def sleep(self) -> None:
        self._sleeping = True
        await self.abort_all()
        self._prefix_cache.clear()

    async def wake_up(self) -> None:
        self._sleeping = False
        if self._work is not None:
            self._work.set()

    async def start_profile(self, **kwargs: Any) -> None:
        self._profile = []
        self._profile_dir = kwargs.get("trace_dir") or os.environ.get("ROLLFLEET_PROFILE_DIR") or tempfile.gettempdir()

    async def stop_profile(self) -> Optional[str]:
        if self._profile is None:
            return None
        os.makedirs(self._profile_dir or ".", exist_ok=True)
        path = os.path.join(
            self._profile_dir or ".", f"sim-replica-{self.replica_index}-{int(time.time() * 1000)}.json"
        )
        with open(path, "w") as f:  # noqa: ASYNC230 - a small trace file, once per profile
            json.dump({"traceEvents": self._profile, "displayTimeUnit": "ms"}, f)
        self._profile = None
        return path

    async def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(False, self._dead)
        if self._hung:
            await asyncio.Event().wait()  # a hung engine does not answer; the prober's timeout decides
        return EngineHealth(True, "paused" if self._paused else "ok")

    async def load(self) -> EngineLoad:
        if self._hung:
            await asyncio.Event().wait()
        self._check_alive()
        self._catch_up(interrupt=False)
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            inflight_tokens=sum(r.context_len for r in self._requests.values()),
            kv_usage=1.0 - self._kv_blocks_free / self._kv_blocks_total,
        )

    def stats(self) -> dict[str, float]:
        self._catch_up(interrupt=False)
        out = dict(self._stats)
        q = out["prefix_cache_query_tokens"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / q if q else 0.0
        out["sim_clock_s"] = self._sim_clock
        return out

    # ------------------------------------------------------------------ test hooks
    def script_responses(self, script: Optional[ResponseScript]) -> None:
        """Let a test choose every response's tokens (``None`` restores the model)."""
        self._script = script

    def inject_fault(self, kind: str, factor: float = 10.0) -> None:
        """``crash``: every request fails and the engine stays dead; ``hang``: the engine stops
        stepping and stops answering probes; ``slow``: steps take ``factor`` times longer;
        ``corrupt_load``: the next weight load silently loads something else (a bad transfer);
        ``none``: clear hang/slow."""
        if self._started:
            self._catch_up()
        if kind == "corrupt_load":
            self._corrupt_next_load = True
        elif kind == "crash":
            self._dead = "engine crashed (injected)"
            self._fail_all(EngineDead(f"sim-{self.replica_index}", self._dead))
        elif kind == "hang":
            self._hung = True
        elif kind == "slow":
            self._slow_factor = float(factor)
        elif kind == "none":
            self._hung = False
            self._slow_factor = 1.0
            if self._work is not None:
                self._work.set()
        else:
            raise ValueError(f"unknown fault kind {kind!r}; valid: crash, hang, slow, corrupt_load, none")

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"sim-{self.replica_index}", self._dead)


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


__all__ = ["SimEngine", "ResponseScript"]
