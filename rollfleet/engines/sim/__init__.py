"""A simulated inference engine: the fleet's stand-in for GPUs in tests, benchmarks and planning.

It is a discrete-time model of a continuous-batching engine (vLLM-like), run on asyncio:

* **Step-time model** (:class:`~rollfleet.engines.sim.cost.StepCost`). One engine step costs
  ``step_base_ms + step_per_seq_ms * running + step_per_context_token_ms * context_tokens +
  prefill_per_token_ms * uncached_prompt_tokens`` of simulated time (``context_tokens``: the
  prompt and generated tokens the running sequences hold), divided by ``time_scale`` in wall time
  (on the event loop's clock: on a virtual-time loop, :mod:`rollfleet.plan`, no wall time at all).
  Every running sequence emits one token per step.
* **Fast-forward** (``max_steps_per_wake`` > 1, :mod:`.steps`): the loop takes the steps up to the
  next one that may change the batch at one wake and produces their tokens when a request leaves
  the batch; the results are those of one step at a time (tests compare them), far cheaper to
  compute: what ``rollfleet plan`` runs.
* **Prefix cache.** Full KV blocks keyed by a chained hash of the block's tokens (as vLLM's
  automatic prefix caching does). A request's prefill only pays for the tokens after its longest
  cached prefix, so the cache really decides the cost of the next turn of a session: route a
  session elsewhere and it pays the whole prefill again. As in vLLM, cached blocks are the KV
  cache's free ones: a block a running request holds is shared with every later request with
  that prefix and never evicted; a finished (or aborted) request frees its blocks tail first into
  an LRU, and a block is evicted when KV is taken for another (``prefix_cache_blocks`` can bound
  the free ones further). With ``cache_on_prefill`` a request's prompt blocks are shared once it
  is prefilled (as in vLLM: GRPO siblings and sessions that run at once share their prompt);
  without it, only once it ends. Block hashes are salted with the weights a request arrived under
  (as rollfleet's vLLM engine salts requests with the weights' label): no request hits a block
  that other weights computed. A keep-mode commit leaves the cache as it is (vLLM cannot reset a
  cache whose blocks are in use); a commit in ``abort`` mode, ``update_weights`` or
  ``clear_kv_cache`` empties it.
* **KV capacity and preemption.** Running sequences hold ``ceil(tokens / block_size)`` blocks of
  ``kv_capacity_tokens``. When a sequence needs a block and none is free, the most recently
  admitted sequence is preempted (recompute mode: its blocks are freed, it goes back to the head
  of the queue keeping its tokens, and pays a re-prefill), and ``num_preempted`` counts it.
* **Response lengths** are long-tailed (log-normal) and depend on the prompt: a prompt-derived
  "difficulty" times per-sample noise, so GRPO siblings have related lengths, as Seer observed.
  A response aborted and resumed on the same engine (prompt plus its tokens) keeps the rest of its
  length (:mod:`.continuations`); resumed on another, it draws a new one.
* **Token ids** are a deterministic function of the weights (every update changes them), the
  prompt and the position; ``temperature > 0`` without a seed adds per-request randomness.
* **Control ops**: abort, abort_all, pause/resume, sleep/wake_up, update_weights, clear_kv_cache,
  start/stop_profile (a Chrome trace of engine steps), health, load.
* **Faults** for tests: ``inject_fault("crash" | "hang" | "slow", factor=...)``.
* **Scripted mode**: ``script_responses(fn)`` lets a test decide the tokens of each response
  (agent-loop tests use it to make tool calls appear).

What was traded away: no chunked prefill, no speculative decoding, one token per step for every
sequence, and a running request holds KV blocks for its whole context even where it shares a
cached prefix with another (vLLM holds shared blocks once).
"""

from rollfleet.engines.sim.cost import StepCost
from rollfleet.engines.sim.engine import ResponseScript, SimEngine

__all__ = ["SimEngine", "ResponseScript", "StepCost"]
