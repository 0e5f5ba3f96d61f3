"""A simulated inference engine: the fleet's stand-in for GPUs in tests, benchmarks and planning.

It is a discrete-time model of a continuous-batching engine (vLLM-like), run on asyncio:

* **Step-time model.** One engine step costs ``step_base_ms + step_per_seq_ms * running +
  prefill_per_token_ms * uncached_prompt_tokens`` of simulated time, divided by ``time_scale``
  in wall time. Every running sequence emits one token per step.
* **Prefix cache.** A bounded LRU over full KV blocks, keyed by a chained hash of the block's
  tokens (as vLLM's automatic prefix caching does). A request's prefill only pays for the tokens
  after its longest cached prefix, so the cache really decides the cost of the next turn of a
  session: route a session elsewhere and it pays the whole prefill again. Finished (and aborted)
  requests insert their blocks. A weight update or ``clear_kv_cache`` empties it.
* **KV capacity and preemption.** Running sequences hold ``ceil(tokens / block_size)`` blocks of
  ``kv_capacity_tokens``. When a sequence needs a block and none is free, the most recently
  admitted sequence is preempted (recompute mode: its blocks are freed, it goes back to the head
  of the queue keeping its tokens, and pays a re-prefill), and ``num_preempted`` counts it.
* **Response lengths** are long-tailed (log-normal) and depend on the prompt: a prompt-derived
  "difficulty" times per-sample noise, so GRPO siblings have related lengths, as Seer observed.
* **Token ids** are a deterministic function of the weights (every update changes them), the
  prompt and the position; ``temperature > 0`` without a seed adds per-request randomness.
* **Control ops**: abort, abort_all, pause/resume, sleep/wake_up, update_weights, clear_kv_cache,
  start/stop_profile (a Chrome trace of engine steps), health, load.
* **Faults** for tests: ``inject_fault("crash" | "hang" | "slow", factor=...)``.
* **Scripted mode**: ``script_responses(fn)`` lets a test decide the tokens of each response
  (agent-loop tests use it to make tool calls appear).

What was traded away: no chunked prefill, no speculative decoding, one token per step for every
sequence, and the prefix cache is accounted apart from KV capacity (it models cached blocks that
stay in free memory).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import tempfile
import time
import zlib
from array import array
from collections import OrderedDict, deque
from typing import Any, Callable, Optional, Sequence

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.engines.base import Engine, EngineHealth, EngineLimits, EngineLoad
from rollfleet.errors import EngineDead
from rollfleet.types import SamplingParams, StopReason, TokenOutput

#: A script maps (request_id, prompt_ids, sampling_params) to the exact response tokens. The
#: response ends with ``stop`` after those tokens unless ``max_tokens`` cuts it first.
ResponseScript = Callable[[str, list[int], SamplingParams], Sequence[int]]

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A fast, process-independent 64-bit mix of integers (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h ^= h >> 31
    return h


def _fingerprint(weights: Any) -> int:
    """A stable number for a weights object: what changes it changes the simulated tokens."""
    if weights is None:
        return 0
    if isinstance(weights, int):
        return weights
    if isinstance(weights, (str, bytes)):
        data = weights.encode() if isinstance(weights, str) else weights
        return zlib.crc32(data)
    if isinstance(weights, dict):
        h = 0
        for key in sorted(weights, key=str):
            value = weights[key]
            summary = repr(getattr(value, "shape", None))
            try:  # torch tensors and numpy arrays: use a checksum of a few values
                flat = value.reshape(-1)[:16]
                summary += repr([float(x) for x in flat])
            except Exception:
                summary += repr(value)[:200]
            h = _mix(h, zlib.crc32(f"{key}:{summary}".encode()))
        return h
    return zlib.crc32(repr(weights).encode())


class _Request:
    __slots__ = (
        "request_id",
        "prompt_ids",
        "max_tokens",
        "target_len",
        "stop_ids",
        "ignore_eos",
        "token_seed",
        "generated",
        "log_probs",
        "future",
        "blocks",
        "num_preempted",
        "admitted_seq",
        "scripted",
        "prefilled",
    )

    def __init__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.target_len = max_tokens
        self.stop_ids: frozenset[int] = frozenset()
        self.ignore_eos = False
        self.token_seed = 0
        self.generated: list[int] = []
        self.log_probs: list[float] = []
        self.future: asyncio.Future[TokenOutput] = asyncio.get_running_loop().create_future()
        self.blocks = 0
        self.num_preempted = 0
        self.admitted_seq = 0
        self.scripted: Optional[list[int]] = None
        self.prefilled = False

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)


class SimEngine(Engine):
    """Simulated continuous-batching engine; see the module docstring for the model."""

    name = "sim"

    def __init__(self, config: SimEngineConfig, *, max_model_len: Optional[int] = None, replica_index: int = 0):
        self.config = config
        self.replica_index = replica_index
        self._max_model_len = max_model_len or config.max_model_len
        self._kv_blocks_total = max(1, config.kv_capacity_tokens // config.block_size)
        self._kv_blocks_free = self._kv_blocks_total
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._prefix_cache: OrderedDict[int, None] = OrderedDict()
        self._weights_seed = _mix(config.seed, 0)
        self._num_updates = 0
        self._admit_counter = 0
        self._paused = False
        self._sleeping = False
        self._started = False
        self._dead: Optional[str] = None
        self._hung = False
        self._slow_factor = 1.0
        self._work = asyncio.Event() if _has_loop() else None
        self._loop_task: Optional[asyncio.Task[None]] = None
        self._script: Optional[ResponseScript] = None
        self._rng = random.Random(_mix(config.seed, replica_index, 17))
        self._profile: Optional[list[dict[str, Any]]] = None
        self._profile_dir: Optional[str] = None
        self._sim_clock = 0.0
        self._stats = {
            "prefix_cache_query_tokens": 0,
            "prefix_cache_hit_tokens": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "num_preemptions": 0,
            "num_aborted": 0,
            "num_finished": 0,
            "num_steps": 0,
            "sim_busy_s": 0.0,
        }

    @classmethod
    def from_config(cls, config: RolloutConfig, replica_index: int) -> "SimEngine":
        sim = config.sim
        if config.max_model_len and config.max_model_len != sim.max_model_len:
            sim = sim.model_copy(update={"max_model_len": config.max_model_len})
        return cls(sim, max_model_len=sim.max_model_len, replica_index=replica_index)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started:
            return
        self._work = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-{self.replica_index}")
        self._started = True

    async def shutdown(self) -> None:
        self._fail_all(EngineDead(f"sim-{self.replica_index}", "engine shut down"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        self._started = False

    def limits(self) -> EngineLimits:
        return EngineLimits(vocab_size=self.config.vocab_size, max_model_len=self._max_model_len)

    def address(self) -> str:
        return f"sim://replica-{self.replica_index}"

    # ------------------------------------------------------------------ data plane
    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        self._check_alive()
        if not self._started:
            await self.start()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight on this engine")
        max_tokens = int(sampling_params["max_tokens"])
        req = _Request(request_id, list(prompt_ids), max_tokens)
        req.stop_ids = frozenset(sampling_params.get("stop_token_ids") or ())
        req.ignore_eos = bool(sampling_params.get("ignore_eos", False))
        prompt_key = zlib.crc32(_int_bytes(prompt_ids))
        temperature = float(sampling_params.get("temperature", 1.0))
        seed = sampling_params.get("seed")
        if seed is not None:
            salt = _mix(int(seed), 1)
        elif temperature == 0.0:
            salt = 0
        else:
            salt = self._rng.getrandbits(63)
        req.token_seed = _mix(self._weights_seed, prompt_key, salt)
        if self._script is not None:
            req.scripted = [int(t) for t in self._script(request_id, list(prompt_ids), dict(sampling_params))]
            req.target_len = len(req.scripted)
            if not req.scripted:  # the script says nothing: an empty response that stopped
                return TokenOutput(token_ids=[], log_probs=[], stop_reason="stop")
        else:
            req.target_len = self._natural_length(prompt_key, salt)
        self._requests[request_id] = req
        self._waiting.append(req)
        assert self._work is not None
        self._work.set()
        try:
            out = await asyncio.shield(req.future)
        except asyncio.CancelledError:
            # The caller gave up: free the engine's resources, never leak a running sequence.
            self._finish(req, "aborted")
            raise
        extras = {k: v for k, v in kwargs.items() if v is not None}
        if extras:  # echoed so tests can see what reached the engine
            out.extra_fields["request_kwargs"] = extras
        return out

    def _natural_length(self, prompt_key: int, salt: int) -> int:
        """Long-tailed response length: prompt difficulty x per-sample noise (log-normal)."""
        cfg = self.config
        sigma = cfg.response_sigma
        mu = math.log(cfg.mean_response_tokens) - sigma * sigma / 2
        r_prompt = random.Random(_mix(prompt_key, cfg.seed, 3))
        r_sample = random.Random(_mix(prompt_key, salt, 5))
        log_len = mu + 0.8 * sigma * r_prompt.gauss(0, 1) + 0.6 * sigma * r_sample.gauss(0, 1)
        return max(1, int(math.exp(log_len)))

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._finish(req, "aborted")

    async def abort_all(self) -> int:
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

    async def update_weights(self, weights: Any) -> None:
        self._check_alive()
        self._num_updates += 1
        self._weights_seed = _mix(self.config.seed, _fingerprint(weights), self._num_updates)
        self._prefix_cache.clear()

    async def clear_kv_cache(self) -> None:
        self._prefix_cache.clear()

    async def start_profile(self, **kwargs: Any) -> None:
        self._profile = []
        self._profile_dir = kwargs.get("trace_dir") or os.environ.get("ROLLFLEET_PROFILE_DIR") or tempfile.gettempdir()

    async def stop_profile(self) -> Optional[str]:
        if self._profile is None:
            return None
        os.makedirs(self._profile_dir or ".", exist_ok=True)
        path = os.path.join(self._profile_dir or ".", f"sim-replica-{self.replica_index}-{int(time.time() * 1000)}.json")
        with open(path, "w") as f:
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
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            inflight_tokens=sum(r.context_len for r in self._requests.values()),
            kv_usage=1.0 - self._kv_blocks_free / self._kv_blocks_total,
        )

    def stats(self) -> dict[str, float]:
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
        ``none``: clear hang/slow."""
        if kind == "crash":
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
            raise ValueError(f"unknown fault kind {kind!r}; valid: crash, hang, slow, none")

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"sim-{self.replica_index}", self._dead)

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self._requests.values()):
            self._release(req)
            if not req.future.done():
                req.future.set_exception(error)
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()

    def _release(self, req: _Request) -> None:
        self._kv_blocks_free += req.blocks
        req.blocks = 0

    def _finish(self, req: _Request, reason: StopReason) -> None:
        if self._requests.pop(req.request_id, None) is None:
            return
        if req in self._running:
            self._running.remove(req)
        else:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
        self._release(req)
        self._insert_prefix(req.prompt_ids + req.generated)
        self._stats["num_aborted" if reason == "aborted" else "num_finished"] += 1
        if not req.future.done():
            req.future.set_result(
                TokenOutput(
                    token_ids=list(req.generated),
                    log_probs=list(req.log_probs),
                    stop_reason=reason,
                    num_preempted=req.num_preempted,
                )
            )

    def _block_hashes(self, tokens: list[int]) -> list[int]:
        bs = self.config.block_size
        hashes = []
        h = 0
        for start in range(0, len(tokens) - bs + 1, bs):
            h = hash((h, tuple(tokens[start : start + bs])))  # int tuples hash the same in every process
            hashes.append(h)
        return hashes

    def _cached_prefix_tokens(self, tokens: list[int]) -> int:
        if self.config.prefix_cache_blocks == 0:
            return 0
        hits = 0
        for h in self._block_hashes(tokens):
            if h not in self._prefix_cache:
                break
            self._prefix_cache.move_to_end(h)
            hits += 1
        return hits * self.config.block_size

    def _insert_prefix(self, tokens: list[int]) -> None:
        cap = self.config.prefix_cache_blocks
        if cap == 0:
            return
        for h in self._block_hashes(tokens):
            self._prefix_cache[h] = None
            self._prefix_cache.move_to_end(h)
        while len(self._prefix_cache) > cap:
            self._prefix_cache.popitem(last=False)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _admit(self) -> int:
        """Move waiting requests into the running batch; return the prefill tokens to pay."""
        prefill = 0
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            req = self._waiting[0]
            need = self._blocks_for(req.context_len + 1)
            if need > self._kv_blocks_free:
                if not self._running and need > self._kv_blocks_total:
                    self._waiting.popleft()
                    self._finish_after_pop(req, "length")
                    continue
                break
            self._waiting.popleft()
            req.blocks = need
            self._kv_blocks_free -= need
            context = req.prompt_ids + req.generated
            cached = self._cached_prefix_tokens(context)
            self._stats["prefix_cache_query_tokens"] += len(context)
            self._stats["prefix_cache_hit_tokens"] += cached
            if not req.prefilled:
                self._stats["prompt_tokens"] += len(req.prompt_ids)
            req.prefilled = True
            prefill += len(context) - cached
            self._admit_counter += 1
            req.admitted_seq = self._admit_counter
            self._running.append(req)
        return prefill

    def _finish_after_pop(self, req: _Request, reason: StopReason) -> None:
        # ``req`` has left the queue already; finish it through the common path.
        self._waiting.appendleft(req)
        self._finish(req, reason)

    def _preempt_one(self) -> bool:
        """Preempt the most recently admitted running sequence (recompute mode)."""
        if not self._running:
            return False
        victim = max(self._running, key=lambda r: r.admitted_seq)
        self._running.remove(victim)
        self._release(victim)
        victim.num_preempted += 1
        self._stats["num_preemptions"] += 1
        self._waiting.appendleft(victim)
        return True

    def _next_token(self, req: _Request) -> tuple[int, float]:
        pos = len(req.generated)
        if req.scripted is not None:
            tok = req.scripted[pos]
        else:
            tok = _mix(req.token_seed, pos) % self.config.vocab_size
            if pos + 1 >= req.target_len and not req.ignore_eos:
                tok = self.config.eos_token_id
            elif tok == self.config.eos_token_id or tok in req.stop_ids:
                tok = (tok + 1) % self.config.vocab_size
                if tok == self.config.eos_token_id or tok in req.stop_ids:
                    tok = (tok + 1) % self.config.vocab_size
        logprob = -((_mix(req.token_seed, pos, 7) % 10_000) / 2_000.0)  # in (-5, 0]
        return tok, logprob

    def _emit(self) -> None:
        cfg = self.config
        for req in list(self._running):
            if req not in self._running:
                continue  # preempted by an earlier sequence in this step
            if self._blocks_for(req.context_len + 1) > req.blocks:
                while self._kv_blocks_free == 0:
                    if not self._preempt_one():
                        break
                    if req not in self._running:
                        break
                if req not in self._running:
                    continue
                req.blocks += 1
                self._kv_blocks_free -= 1
            tok, lp = self._next_token(req)
            req.generated.append(tok)
            req.log_probs.append(lp)
            self._stats["generation_tokens"] += 1
            n = len(req.generated)
            if req.scripted is not None and n >= len(req.scripted):
                self._finish(req, "stop")
            elif n >= req.max_tokens:
                self._finish(req, "length")
            elif not req.ignore_eos and (tok == cfg.eos_token_id or tok in req.stop_ids):
                self._finish(req, "stop")
            elif req.context_len >= self._max_model_len:
                self._finish(req, "length")

    async def _run(self) -> None:
        assert self._work is not None
        anchor: Optional[tuple[float, float]] = None  # (wall, simulated) time when busy began
        while True:
            if self._dead is not None:
                return
            if self._paused or self._sleeping or self._hung or not self._requests:
                anchor = None
                self._work.clear()
                await self._work.wait()
                continue
            prefill = self._admit()
            if not self._running:
                anchor = None
                self._work.clear()
                await self._work.wait()
                continue
            cfg = self.config
            step_ms = (
                cfg.step_base_ms + cfg.step_per_seq_ms * len(self._running) + cfg.prefill_per_token_ms * prefill
            ) * self._slow_factor
            started = time.perf_counter()
            # Pace against an anchor rather than sleeping each step: sub-millisecond steps (large
            # time scales) would otherwise each pay the event loop's sleep overhead.
            if anchor is None:
                anchor = (time.monotonic(), self._sim_clock)
            target = anchor[0] + (self._sim_clock + step_ms / 1000.0 - anchor[1]) / cfg.time_scale
            await asyncio.sleep(max(0.0, target - time.monotonic()))
            if self._paused or self._sleeping or self._hung or self._dead is not None:
                continue  # the step was interrupted; its tokens are not emitted
            if self._slow_factor != 1.0:
                anchor = None
            self._emit()
            self._sim_clock += step_ms / 1000.0
            self._stats["num_steps"] += 1
            self._stats["sim_busy_s"] += step_ms / 1000.0
            if self._profile is not None:
                self._profile.append(
                    {
                        "name": "step",
                        "ph": "X",
                        "ts": started * 1e6,
                        "dur": (time.perf_counter() - started) * 1e6,
                        "pid": self.replica_index,
                        "tid": 0,
                        "args": {"running": len(self._running), "prefill_tokens": prefill, "sim_ms": step_ms},
                    }
                )


def _int_bytes(ids: Sequence[int]) -> bytes:
    return array("q", ids).tobytes()


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


__all__ = ["SimEngine", "ResponseScript"]
