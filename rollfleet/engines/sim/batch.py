"""The continuous-batching model of the sim engine: requests, the running batch, KV blocks, the
prefix cache, preemption and token emission (no asyncio tasks, no I/O).

:class:`BatchModel` holds the engine's batching state and the steps that change it; the engine
(:mod:`.engine`) owns the loop that paces the steps and the control ops. See the package docstring
for the model itself and what it trades away.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
from collections import deque
from typing import Any, Optional

from rollfleet.config import SimEngineConfig
from rollfleet.engines.sim.continuations import Continuations, prompt_key_of
from rollfleet.engines.sim.prefix import PrefixCache
from rollfleet.engines.sim.tokens import _mix, next_token, tokens
from rollfleet.types import StopReason, TokenOutput


class _Request:
    __slots__ = (
        "request_id",
        "prompt_ids",
        "max_tokens",
        "target_len",
        "stop_ids",
        "ignore_eos",
        "min_tokens",
        "token_seed",
        "generated",
        "log_probs",
        "future",
        "blocks",
        "num_preempted",
        "admitted_seq",
        "scripted",
        "prefilled",
        "versions",
        "sample_key",
        "progress",
        "pending",
        "end_at",
        "hashes",
        "cache_hold",
        "cache_salt",
        "cache_epoch",
        "hit_blocks",
    )

    def __init__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.target_len = max_tokens
        self.stop_ids: frozenset[int] = frozenset()
        self.ignore_eos = False
        self.min_tokens = 0  # tokens before which neither the EOS nor a stop id ends it
        self.token_seed = 0
        self.generated: list[int] = []
        self.log_probs: list[float] = []
        self.future: asyncio.Future[TokenOutput] = asyncio.get_running_loop().create_future()
        self.blocks = 0
        self.num_preempted = 0
        self.admitted_seq = 0
        self.scripted: Optional[list[int]] = None
        self.prefilled = False
        self.versions: list[Optional[int]] = []  # the weight version label of each generated token
        self.sample_key = (0, 0)  # (prompt key, sampling salt): the token seed under any weights
        self.progress: Optional[asyncio.Event] = None  # set on every new token when streamed
        # Tokens a fast-forward (:mod:`.steps`) counted but has not produced yet: produced, all at
        # once, when the request leaves the batch or the weights change.
        self.pending = 0
        self.end_at = 0  # tokens it has when it ends at the latest (0: any step may end it)
        self.hashes: list[int] = []  # of its context's full blocks so far (its context only grows)
        self.cache_hold = (0, 0)  # what the prefix cache holds for it while it runs (PrefixCache.hold)
        self.cache_salt = 0  # the weights it arrived under (0: the boot weights): its hashes' seed
        self.cache_epoch = 0  # the prefix cache's epoch when it was admitted (its KV computed since)
        self.hit_blocks = 0  # of its blocks, those the cache served when it was admitted

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated) + self.pending


@functools.lru_cache(maxsize=1 << 14)
def _prompt_difficulty(prompt_key: int, seed: int) -> float:
    """A prompt's share of its responses' log-length, a standard normal draw: the same for every
    sample of a group, so it is drawn once per prompt (seeding a ``Random`` is most of the cost)."""
    return random.Random(_mix(prompt_key, seed, 3)).gauss(0, 1)


class BatchModel:
    """The batching half of :class:`~rollfleet.engines.sim.SimEngine` (its state is the engine's)."""

    config: SimEngineConfig
    replica_index: int
    _max_model_len: int
    _kv_blocks_total: int
    _kv_blocks_free: int
    _requests: dict[str, _Request]
    _waiting: deque[_Request]
    _running: list[_Request]
    _prefix_cache: PrefixCache
    _admit_counter: int
    _unpaid: dict["_Request", int]
    _left_in_prefill: list["_Request"]
    _run_now: Any  # the steps the loop sleeps through (StepLoop's), None between them
    _stats: dict[str, Any]
    _version_label: Optional[int]
    _rng: random.Random
    _weights_seed: int
    _continuations: Continuations

    def _seed_request(self, req: _Request, sampling_params: Any) -> tuple[int, int]:
        """The request's sampling keys: ``(prompt key, salt)``; the same prompt with a seed (or at
        temperature 0) samples the same tokens under the same weights."""
        prompt_key = prompt_key_of(req.prompt_ids)
        temperature = float(sampling_params.get("temperature", 1.0))
        seed = sampling_params.get("seed")
        if seed is not None:
            salt = _mix(int(seed), 1)
        elif temperature == 0.0:
            salt = 0
        else:
            salt = self._rng.getrandbits(63)
        req.sample_key = (prompt_key, salt)
        req.token_seed = _mix(self._weights_seed, prompt_key, salt)
        return prompt_key, salt

    def _remember_continuation(self, req: _Request) -> None:
        """An aborted response goes on where it stopped when resumed (see :mod:`.continuations`)."""
        done = len(req.generated)
        if done and req.scripted is None and req.target_len > done:
            self._continuations.remember(req.prompt_ids + req.generated, req.target_len - done)

    def _natural_length(self, prompt_key: int, salt: int) -> int:
        """Long-tailed response length: prompt difficulty x per-sample noise (log-normal), or a draw
        from ``response_lengths`` where given."""
        cfg = self.config
        if cfg.response_lengths:
            return cfg.response_lengths[random.Random(_mix(prompt_key, salt, 5)).randrange(len(cfg.response_lengths))]
        sigma = cfg.response_sigma
        mu = math.log(cfg.mean_response_tokens) - sigma * sigma / 2
        r_sample = random.Random(_mix(prompt_key, salt, 5))
        log_len = mu + 0.8 * sigma * _prompt_difficulty(prompt_key, cfg.seed) + 0.6 * sigma * r_sample.gauss(0, 1)
        return max(1, int(math.exp(log_len)))

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self._requests.values()):
            self._release(req)
            if not req.future.done():
                req.future.set_exception(error)
            if req.progress is not None:
                req.progress.set()
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()

    def _release(self, req: _Request) -> None:
        unpaid = self._unpaid.pop(req, None)  # it left the batch: re-admitted, it pays again
        self._kv_blocks_free += req.blocks
        req.blocks = 0
        if req.cache_hold[0]:
            # Its prefill not done (the step doing it has not ended), only the blocks the cache
            # served it hold KV yet; the rest are cached if that step ends (see _leave).
            computed = req.hit_blocks if unpaid is not None else None
            self._prefix_cache.release(req.hashes, req.cache_hold, self._kv_blocks_free, computed)
            req.cache_hold = (0, 0)

    def _leave(self, req: _Request) -> None:
        """Take ``req`` out of the batch, free its KV blocks and cache what they computed: at once
        if a step that ended did its prefill, or when the step doing it ends (a step a pause or a
        weight load throws away computed nothing). A waiting request's blocks were never computed,
        or were freed when it was preempted: caching them would serve hits nobody computed."""
        running = req in self._running
        # admitted for a step that has not ended (one whose whole context hit the cache too: what
        # it hit may be another's prefill in that very step)
        in_prefill = running and req in self._unpaid
        if running:
            self._running.remove(req)
        else:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
        self._release(req)
        if in_prefill:
            if self._run_now is not None:  # its step may yet end (else it was thrown away: nothing to cache)
                self._left_in_prefill.append(req)
        elif running:
            self._cache_computed(req)

    def _finish(self, req: _Request, reason: StopReason) -> None:
        if self._requests.pop(req.request_id, None) is None:
            return
        self._materialize(req)
        self._leave(req)
        if reason == "aborted":
            self._remember_continuation(req)
        self._stats["num_aborted" if reason == "aborted" else "num_finished"] += 1
        if req.progress is not None:
            req.progress.set()
        if not req.future.done():
            req.future.set_result(
                # model_construct: the engine's own lists, already typed; validating every token of
                # every answer was 2% of a plan's wall time. Every field is given: one left to its
                # default_factory makes pydantic inspect the factory's signature on each call (3x
                # the cost of the whole construction).
                TokenOutput.model_construct(
                    token_ids=list(req.generated),
                    log_probs=list(req.log_probs),
                    stop_reason=reason,
                    num_preempted=req.num_preempted,
                    # The engine knows which weights sampled each token: the version its last
                    # commit named, None before any (the weights it booted with). Always given, so
                    # an answer that reaches the replica after a commit is still labelled exactly.
                    token_versions=list(req.versions),
                    routed_experts=None,
                    extra_fields={},
                )
            )

    def _hashes_of(self, req: _Request) -> list[int]:
        """The chained hashes of ``req``'s full context blocks, extending those computed before
        (a request is looked up and inserted up to three times; its tokens are hashed once)."""
        bs = self.config.block_size
        hashes = req.hashes
        start = len(hashes) * bs
        tokens = (req.prompt_ids + req.generated)[start:]
        h = hashes[-1] if hashes else req.cache_salt  # blocks of other weights never match
        append = hashes.append
        # zip of one iterator bs times: the full blocks as tuples, cut in C (a slice and a tuple
        # per block cost 1.4x more); int tuples hash the same in every process.
        for block in zip(*[iter(tokens)] * bs):
            h = hash((h, block))
            append(h)
        return hashes

    def _insert_prefix(self, hashes: list[int]) -> None:
        self._prefix_cache.insert(hashes, self._kv_blocks_free)

    def _cache_computed(self, req: _Request) -> None:
        """The blocks of ``req``, which ran and now leaves the batch (finished, aborted or
        preempted), stay cached as free blocks, as vLLM's freed blocks keep their hashes; unless
        the cache was cleared since it was admitted: it computed them under the weights before,
        and a request queued under those weights' salt would hit them."""
        if req.cache_epoch == self._prefix_cache.epoch:
            self._insert_prefix(self._hashes_of(req))

    def _evict(self) -> None:
        self._prefix_cache.evict(self._kv_blocks_free)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _admit(self) -> int:
        """Move waiting requests into the running batch; return the prefill tokens the next step
        pays: those of the requests admitted now, and those of requests admitted for a step that
        never ended (stopped by a weight load, a hang, a pause), whose prefill was not done."""
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
            hashes = self._hashes_of(req)
            req.hit_blocks = self._prefix_cache.hit_blocks(hashes)
            cached = req.hit_blocks * self.config.block_size
            self._stats["prefix_cache_query_tokens"] += len(context)
            self._stats["prefix_cache_hit_tokens"] += cached
            if not req.prefilled:
                self._stats["prompt_tokens"] += len(req.prompt_ids)
            req.prefilled = True
            self._unpaid[req] = len(context) - cached
            req.cache_epoch = self._prefix_cache.epoch
            if self.config.cache_on_prefill:  # its blocks are computed now: later requests reuse them
                req.cache_hold = self._prefix_cache.hold(hashes, req.hit_blocks)
            self._evict()  # after the lookup, as vLLM takes the blocks it hit before allocating
            self._admit_counter += 1
            req.admitted_seq = self._admit_counter
            self._running.append(req)
        return sum(self._unpaid.values())

    def _finish_after_pop(self, req: _Request, reason: StopReason) -> None:
        # ``req`` has left the queue already; finish it through the common path.
        self._waiting.appendleft(req)
        self._finish(req, reason)

    def _preempt_one(self) -> bool:
        """Preempt the most recently admitted running sequence (recompute mode)."""
        if not self._running:
            return False
        victim = max(self._running, key=lambda r: r.admitted_seq)
        self._materialize(victim)
        self._leave(victim)  # its recompute hits what is left of its blocks in the cache, as in vLLM
        victim.num_preempted += 1
        self._stats["num_preemptions"] += 1
        self._waiting.appendleft(victim)
        return True

    def _next_token(self, req: _Request) -> tuple[int, float]:
        return next_token(req, self.config.vocab_size, self.config.eos_token_id)

    def _materialize(self, req: _Request) -> None:
        """Produce the tokens a fast-forward counted for ``req`` (all of them at once, vectorised:
        the same ids and logprobs :meth:`_next_token` gives one by one, under the weights and
        version label of now, which is why every weight change materializes first)."""
        if not req.pending:
            return
        start, count = len(req.generated), req.pending
        req.pending = 0
        ids, logprobs = tokens(req, start, count, self.config.vocab_size, self.config.eos_token_id)
        req.generated.extend(ids)
        req.log_probs.extend(logprobs)
        req.versions.extend([self._version_label] * count)

    def _stop_reason(self, req: _Request, tok: int) -> Optional[StopReason]:
        """Why ``req`` ends with ``tok``, its last token (produced: :meth:`_materialize` first), or
        None while it goes on."""
        n = len(req.generated)
        if req.scripted is not None and n >= len(req.scripted):
            return "stop"
        # A stop sampled as the last token the budget allows is a stop, as vLLM reports it (RL code
        # penalises or filters "length" as truncated).
        # ignore_eos ignores the EOS only: a stop token id still ends it (vLLM's check_stop); and
        # before min_tokens neither can (vLLM masks them out of the sampling until then)
        if n > req.min_tokens and ((tok == self.config.eos_token_id and not req.ignore_eos) or tok in req.stop_ids):
            return "stop"
        if n >= req.max_tokens:
            return "length"
        if len(req.prompt_ids) + n >= self._max_model_len:
            return "length"
        return None

    def _latest_end(self, req: _Request) -> int:
        """How many tokens ``req`` has when it ends at the latest, known when it is submitted (the
        length it was drawn, ``max_tokens``, the context, a stop in its script), or 0 where a
        sampled id may be a stop id (then only stepping finds out)."""
        end = min(req.max_tokens, self._max_model_len - len(req.prompt_ids))
        avoided = req.stop_ids | {self.config.eos_token_id}  # ids sampling steps around
        stops = req.stop_ids if req.ignore_eos else avoided  # ids that end it
        if req.scripted is not None:
            end = min(end, len(req.scripted))
            for i, tok in enumerate(req.scripted[:end]):
                if tok in stops and i >= req.min_tokens:
                    return i + 1
        elif stops:
            if not req.ignore_eos:
                end = min(end, req.target_len)
            vocab = self.config.vocab_size
            # A sampled stop id becomes the next id, twice at most: only three avoided ids in a
            # row let one through.
            if any((s + 1) % vocab in avoided and (s + 2) % vocab in avoided for s in avoided):
                return 0
        return max(1, end)

    def _emit(self) -> None:
        """One step: every running sequence samples one token (allocating a KV block, or
        preempting for one, when it needs one)."""
        for req in list(self._running):
            if req not in self._running:
                continue  # preempted by an earlier sequence in this step
            self._materialize(req)
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
                self._evict()
            tok, lp = self._next_token(req)
            req.generated.append(tok)
            req.log_probs.append(lp)
            req.versions.append(self._version_label)
            if req.progress is not None:
                req.progress.set()
            self._stats["generation_tokens"] += 1
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)


__all__ = ["BatchModel", "_Request"]
