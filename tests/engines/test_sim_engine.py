"""The simulated engine: its model must behave like an engine, or the benchmarks lie."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from rollfleet.config import SimEngineConfig
from rollfleet.engines.sim import SimEngine
from rollfleet.errors import EngineDead, InvalidRequest
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


def cfg(**kw):
    base = dict(vocab_size=1000, time_scale=1000.0, mean_response_tokens=50)
    base.update(kw)
    return SimEngineConfig(**base)


async def started(**kw) -> SimEngine:
    eng = SimEngine(cfg(**kw))
    await eng.start()
    return eng


async def test_generate_lengths_logprobs_and_stop_reasons():
    eng = await started()
    out = await eng.generate("a", list(range(1, 40)), {"max_tokens": 5, "ignore_eos": True})
    assert len(out.token_ids) == 5 and len(out.log_probs) == 5 and out.stop_reason == "length"
    out = await eng.generate("b", list(range(1, 40)), {"max_tokens": 10_000})
    assert out.stop_reason == "stop" and out.token_ids[-1] == eng.config.eos_token_id
    assert all(0 <= t < 1000 for t in out.token_ids)
    await eng.shutdown()


async def test_prefix_cache_decides_prefill_cost_of_next_turn():
    eng = await started(block_size=16)
    turn1 = list(range(1, 200))
    out = await eng.generate("t1", turn1, {"max_tokens": 20, "ignore_eos": True})
    st0 = eng.stats()
    turn2 = turn1 + out.token_ids + list(range(300, 340))
    await eng.generate("t2", turn2, {"max_tokens": 5})
    st1 = eng.stats()
    hits = st1["prefix_cache_hit_tokens"] - st0["prefix_cache_hit_tokens"]
    assert hits >= (len(turn1) + len(out.token_ids)) // 16 * 16 - 16
    # a replica that never saw the session pays the full prefill
    cold = await started(block_size=16)
    await cold.generate("t2", turn2, {"max_tokens": 5})
    assert cold.stats()["prefix_cache_hit_tokens"] == 0
    # the cache is bounded and a weight update clears it
    await eng.update_weights({"v": 1})
    before = eng.stats()["prefix_cache_hit_tokens"]
    await eng.generate("t3", turn2, {"max_tokens": 5})
    assert eng.stats()["prefix_cache_hit_tokens"] == before
    await eng.shutdown()
    await cold.shutdown()


async def test_prefix_cache_is_bounded():
    eng = await started(block_size=16, prefix_cache_blocks=4)
    await eng.generate("a", list(range(1, 500)), {"max_tokens": 2})
    assert len(eng._prefix_cache) == 4
    await eng.shutdown()


async def test_prefix_cache_holds_the_free_kv_blocks_and_evicts_a_prompt_last():
    """As vLLM: cached blocks are the free ones, so a request that takes KV evicts them; a finished
    request's blocks are freed tail first, so its prompt (what siblings and next turns share) goes
    last. 64 blocks of KV; ``a`` leaves 40 cached; ``b`` takes 51, leaving room for 13."""
    eng = await started(block_size=16, kv_capacity_tokens=64 * 16)
    prompt_a = list(range(1, 641))  # 40 blocks
    await eng.generate("a", prompt_a, {"max_tokens": 2, "ignore_eos": True})
    assert len(eng._prefix_cache) == 40
    await eng.generate("b", list(range(100, 900)), {"max_tokens": 10, "ignore_eos": True})
    before = eng.stats()["prefix_cache_hit_tokens"]
    await eng.generate("a2", prompt_a + [5], {"max_tokens": 1})
    assert eng.stats()["prefix_cache_hit_tokens"] - before == 13 * 16  # a's first 13 blocks
    await eng.shutdown()


def test_a_prompt_hit_from_the_free_blocks_is_evicted_tail_first_too():
    """A hit makes a prompt's free blocks most recent, its head last of all (as a finished request
    frees them): an eviction takes its tail, and the rest still hits. Refreshed head first, the
    head went first and the blocks left could never be hit again (a lookup stops at a miss)."""

    async def main() -> tuple[int, int]:
        eng = SimEngine(SimEngineConfig(vocab_size=500, block_size=4, kv_capacity_tokens=64))  # 16 blocks
        await eng.start()
        prompt = list(range(10, 26))  # 4 blocks
        await eng.generate("a", prompt, {"max_tokens": 1, "ignore_eos": True})  # leaves them cached, free
        running = asyncio.create_task(eng.generate("b", prompt, {"max_tokens": 30, "ignore_eos": True}))
        await asyncio.sleep(0.001)  # b hit all 4 (without holding them) and runs
        assert eng.stats()["prefix_cache_hit_tokens"] == 16
        await eng.generate("c", [400] * 31, {"max_tokens": 1, "ignore_eos": True})  # its 8 blocks evict some
        cache, hashes = eng._prefix_cache, eng._hashes_of(eng._requests["b"])[:4]
        cached = sum(h in cache._free for h in hashes)  # the prompt's blocks still cached
        hit = cache.hit_blocks(hashes)
        assert not running.done()
        await eng.abort("b")
        await running
        await eng.shutdown()
        return cached, hit

    cached, hit = virtual_time.run(main())
    assert 0 < cached < 4 and hit == cached


async def test_a_running_request_keeps_its_prompt_cached_under_any_pressure():
    """A block a running request holds is shared with later requests and never evicted, however
    small the bound on the free ones: the 8th sibling of a group finds the prompt the first one
    prefilled while it still runs."""
    eng = await started(block_size=16, prefix_cache_blocks=4, cache_on_prefill=True)
    prompt = list(range(1, 321))  # 20 blocks
    first = asyncio.create_task(eng.generate("first", prompt, {"max_tokens": 3000, "ignore_eos": True}))
    while eng.stats()["prompt_tokens"] == 0:
        await asyncio.sleep(0.001)
    for i in range(3):  # others finish and insert their blocks: the free LRU keeps 4 of them
        await eng.generate(f"other{i}", list(range(400 + 50 * i, 700 + 50 * i)), {"max_tokens": 2, "ignore_eos": True})
    assert len(eng._prefix_cache) == 4 and not first.done()
    before = eng.stats()["prefix_cache_hit_tokens"]
    await eng.generate("sibling", prompt, {"max_tokens": 1, "ignore_eos": True})
    assert eng.stats()["prefix_cache_hit_tokens"] - before == 320
    await eng.abort("first")
    assert (await first).stop_reason == "aborted"
    await eng.shutdown()


async def test_cached_prefill_is_faster_in_simulated_time():
    eng = await started(block_size=16, prefill_per_token_ms=1.0)
    prompt = list(range(1, 900))
    await eng.generate("warm", prompt, {"max_tokens": 1})
    t0 = eng.stats()["sim_clock_s"]
    await eng.generate("hit", prompt + [5], {"max_tokens": 1})
    hit_cost = eng.stats()["sim_clock_s"] - t0
    cold = await started(block_size=16, prefill_per_token_ms=1.0)
    await cold.generate("miss", prompt + [5], {"max_tokens": 1})
    assert cold.stats()["sim_clock_s"] > 5 * hit_cost
    await eng.shutdown()
    await cold.shutdown()


async def test_kv_capacity_preempts_and_requests_still_finish():
    eng = await started(kv_capacity_tokens=64 * 16, block_size=16, max_num_seqs=64)
    outs = await asyncio.gather(
        *(eng.generate(f"r{i}", list(range(1, 60)), {"max_tokens": 120, "ignore_eos": True}) for i in range(24))
    )
    assert all(len(o.token_ids) == 120 for o in outs)
    assert sum(o.num_preempted for o in outs) > 0
    assert eng.stats()["num_preemptions"] > 0
    assert (await eng.load()).kv_usage == 0.0
    await eng.shutdown()


async def test_response_lengths_are_long_tailed_and_depend_on_prompt():
    eng = await started(mean_response_tokens=200, response_sigma=1.0, max_num_seqs=512)
    outs = await asyncio.gather(
        *(eng.generate(f"r{i}", [1 + i % 97, 2 + i, 3], {"max_tokens": 20_000}) for i in range(300))
    )
    lengths = [len(o.token_ids) for o in outs]
    assert max(lengths) > 4 * statistics.median(lengths)  # a long tail
    # the same prompt sampled greedily gives the same length; another prompt differs
    a = await eng.generate("x1", [5, 6, 7], {"max_tokens": 20_000, "temperature": 0})
    b = await eng.generate("x2", [5, 6, 7], {"max_tokens": 20_000, "temperature": 0})
    assert a.token_ids == b.token_ids
    await eng.shutdown()


async def test_tokens_depend_on_weight_version():
    eng = await started()
    params = {"max_tokens": 16, "ignore_eos": True, "temperature": 0}
    a = await eng.generate("a", [1, 2, 3], params)
    b = await eng.generate("b", [1, 2, 3], params)
    await eng.update_weights({"layer": 1})
    c = await eng.generate("c", [1, 2, 3], params)
    assert a.token_ids == b.token_ids != c.token_ids
    await eng.shutdown()


def test_a_load_mid_request_samples_the_rest_from_the_new_weights():
    """``update_weights`` on a running engine: the tokens after it come from the new weights, as
    after a ``keep`` commit (they used to keep the old weights' stream to the end)."""

    async def tokens(load: str | None) -> list[int]:
        eng = SimEngine(SimEngineConfig(vocab_size=1000, time_scale=1.0))
        await eng.start()
        params = {"max_tokens": 40, "ignore_eos": True, "seed": 1}
        running = asyncio.create_task(eng.generate("a", list(range(5, 40)), params))
        await asyncio.sleep(0.07)  # about ten steps in
        if load == "update":
            await eng.update_weights({"v": 1})
        elif load == "commit":
            await eng.stage_weights({"v": 1}, 1)
            await eng.commit_weights(1, mode="keep")
        out = await running
        await eng.shutdown()
        return out.token_ids

    base, updated, committed = (virtual_time.run(tokens(load)) for load in (None, "update", "commit"))
    assert updated[:5] == base[:5] and updated != base
    assert committed[:5] == base[:5] and committed != base


async def test_a_request_the_engine_cannot_serve_is_refused_naming_the_field():
    """The replica validates every request; an engine called directly (calibration, tests) still
    refuses what its arithmetic cannot do, where it used to answer one token."""
    eng = await started(max_model_len=64)
    for prompt, params, field in (
        ([1, 2], {"max_tokens": 0}, "sampling_params.max_tokens"),
        ([1, 2], {"max_tokens": -3}, "sampling_params.max_tokens"),
        (list(range(1, 101)), {"max_tokens": 4}, "prompt_ids"),
        (list(range(1, 65)), {"max_tokens": 4}, "prompt_ids"),
        ([], {"max_tokens": 4}, "prompt_ids"),
        ([1, 2], {"max_tokens": 4, "temperature": -1.0}, "sampling_params.temperature"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            await eng.generate("r", prompt, params)
        assert refused.value.field == field
    out = await eng.generate("ok", list(range(1, 64)), {"max_tokens": 4, "ignore_eos": True})
    assert len(out.token_ids) == 1 and out.stop_reason == "length"  # the context's last slot
    load = await eng.load()
    assert load.running == load.waiting == 0
    await eng.shutdown()


async def test_time_scale_compresses_simulated_time():
    slow = await started(time_scale=1.0, step_base_ms=5.0, step_per_seq_ms=0.0)
    fast = await started(time_scale=50.0, step_base_ms=5.0, step_per_seq_ms=0.0)
    loop = asyncio.get_running_loop()
    t = loop.time()
    await slow.generate("a", [1], {"max_tokens": 40, "ignore_eos": True})
    slow_wall = loop.time() - t
    t = loop.time()
    await fast.generate("a", [1], {"max_tokens": 40, "ignore_eos": True})
    fast_wall = loop.time() - t
    assert slow_wall > 0.19 and fast_wall < slow_wall / 5
    await slow.shutdown()
    await fast.shutdown()


async def test_pause_aborts_with_partial_tokens_and_holds_new_requests():
    eng = await started(time_scale=1.0, step_base_ms=2.0)
    long = asyncio.ensure_future(eng.generate("long", [1, 2], {"max_tokens": 10_000, "ignore_eos": True}))
    await asyncio.sleep(0.1)
    await eng.pause()
    out = await long
    assert out.stop_reason == "aborted" and 0 < len(out.token_ids) < 10_000
    held = asyncio.ensure_future(eng.generate("held", [1, 2], {"max_tokens": 3, "ignore_eos": True}))
    await asyncio.sleep(0.1)
    assert not held.done()
    await eng.resume()
    assert len((await held).token_ids) == 3
    await eng.shutdown()


async def test_abort_one_and_abort_all_and_cancellation():
    eng = await started(time_scale=1.0, step_base_ms=2.0)
    a = asyncio.ensure_future(eng.generate("a", [1], {"max_tokens": 10_000, "ignore_eos": True}))
    b = asyncio.ensure_future(eng.generate("b", [1], {"max_tokens": 10_000, "ignore_eos": True}))
    c = asyncio.ensure_future(eng.generate("c", [1], {"max_tokens": 10_000, "ignore_eos": True}))
    await asyncio.sleep(0.05)
    await eng.abort("a")
    assert (await a).stop_reason == "aborted"
    c.cancel()
    await asyncio.sleep(0.01)
    assert (await eng.load()).running == 1
    assert await eng.abort_all() == 1
    assert (await b).stop_reason == "aborted"
    load = await eng.load()
    assert load.running == load.waiting == 0 and load.kv_usage == 0
    await eng.shutdown()


async def test_sleep_wake_clear_profile_health(tmp_path):
    eng = await started()
    await eng.start_profile(trace_dir=str(tmp_path))
    await eng.generate("a", [1, 2], {"max_tokens": 4, "ignore_eos": True})
    path = await eng.stop_profile()
    assert path and (tmp_path / path.split("/")[-1]).exists()
    await eng.sleep()
    held = asyncio.ensure_future(eng.generate("b", [1, 2], {"max_tokens": 2}))
    await asyncio.sleep(0.05)
    assert not held.done()
    await eng.wake_up()
    await held
    await eng.clear_kv_cache()
    assert (await eng.health()).healthy
    await eng.shutdown()


async def test_faults_crash_hang_slow():
    eng = await started(time_scale=1.0, step_base_ms=2.0)
    pending = asyncio.ensure_future(eng.generate("a", [1], {"max_tokens": 10_000, "ignore_eos": True}))
    await asyncio.sleep(0.02)
    eng.inject_fault("crash")
    with pytest.raises(EngineDead):
        await pending
    with pytest.raises(EngineDead):
        await eng.generate("b", [1], {"max_tokens": 2})
    assert not (await eng.health()).healthy
    hung = await started()
    hung.inject_fault("hang")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(hung.health(), 0.1)
    hung.inject_fault("none")
    assert (await hung.health()).healthy
    with pytest.raises(ValueError, match="valid"):
        hung.inject_fault("explode")
    await hung.shutdown()


async def test_scripted_responses():
    eng = await started()
    eng.script_responses(lambda rid, prompt, params: [7, 8, 9])
    out = await eng.generate("s", [1, 2], {"max_tokens": 10})
    assert out.token_ids == [7, 8, 9] and out.stop_reason == "stop"
    out = await eng.generate("s2", [1, 2], {"max_tokens": 2})
    assert out.token_ids == [7, 8] and out.stop_reason == "length"
    await eng.shutdown()


async def test_empty_script_gives_an_empty_stopped_response():
    eng = await started()
    eng.script_responses(lambda rid, prompt, params: [])
    out = await eng.generate("e", [1, 2], {"max_tokens": 5})
    assert out.token_ids == [] and out.stop_reason == "stop"
    await eng.shutdown()


async def test_response_lengths_are_drawn_from_the_given_samples():
    eng = await started(response_lengths=[7, 300])
    lengths = []
    for i in range(40):
        out = await eng.generate(f"r{i}", [1 + i % 9, 2, 3], {"max_tokens": 1000})
        lengths.append(len(out.token_ids))
    await eng.shutdown()
    assert set(lengths) == {7, 300}  # only the given lengths, and both of them
    with pytest.raises(ValueError, match="response_lengths"):
        cfg(response_lengths=[5, 0])


def test_a_pause_or_resume_during_a_weight_load_holds_after_it():
    """A commit stops the steps while it loads; what the operator does meanwhile is theirs: a pause
    stays paused after the load, a resume runs again (the commit used to restore the pause flag it
    found, undoing both)."""
    params = {"max_tokens": 20, "ignore_eos": True}

    async def main() -> tuple[str, bool, bool]:
        paused = SimEngine(SimEngineConfig(vocab_size=500, weight_load_ms=50.0, step_base_ms=10.0))
        await paused.start()
        await paused.stage_weights({"w": 1}, 1)
        commit = asyncio.ensure_future(paused.commit_weights(1, "keep"))
        await asyncio.sleep(0.01)  # loading
        await paused.pause()
        await commit
        health = (await paused.health()).detail
        held = asyncio.ensure_future(paused.generate("x", [5] * 16, params))
        await asyncio.sleep(1.0)
        held_ran = held.done()
        await paused.resume()
        await held
        await paused.shutdown()

        resumed = SimEngine(SimEngineConfig(vocab_size=500, weight_load_ms=50.0, step_base_ms=10.0))
        await resumed.start()
        await resumed.pause()
        await resumed.stage_weights({"w": 1}, 1)
        commit = asyncio.ensure_future(resumed.commit_weights(1, "abort"))
        await asyncio.sleep(0.01)
        await resumed.resume()
        sent = asyncio.ensure_future(resumed.generate("y", [5] * 16, params))
        await commit
        await asyncio.sleep(1.0)
        ran = sent.done()
        await resumed.shutdown()
        return health, held_ran, ran

    assert virtual_time.run(main()) == ("paused", False, True)


def test_a_keep_commit_salts_the_prefix_cache_as_the_vllm_engine_does():
    """After a keep-mode commit, a request that arrived before it still shares its prompt with a
    running sibling (the blocks are in use: vLLM cannot reset them, and their salt is the same),
    and a request that arrives after it hits nothing the old weights computed (the salt differs),
    not even blocks freed after the commit."""
    prompt = list(range(1, 321))  # 20 blocks of 16

    async def main() -> tuple[int, int]:
        eng = SimEngine(SimEngineConfig(vocab_size=500, block_size=16, cache_on_prefill=True, step_base_ms=10.0))
        await eng.start()
        first = asyncio.ensure_future(eng.generate("first", prompt, {"max_tokens": 50, "ignore_eos": True}))
        while eng.stats()["prompt_tokens"] == 0:
            await asyncio.sleep(0.001)
        await eng.pause()
        sibling = asyncio.ensure_future(eng.generate("sibling", prompt, {"max_tokens": 1, "ignore_eos": True}))
        await asyncio.sleep(0.01)  # it arrived under the old weights
        await eng.stage_weights({"w": 1}, 1)
        await eng.commit_weights(1, "keep")
        await eng.resume()
        before = eng.stats()["prefix_cache_hit_tokens"]
        await sibling
        sibling_hits = eng.stats()["prefix_cache_hit_tokens"] - before
        await first  # its blocks are freed now, after the commit
        before = eng.stats()["prefix_cache_hit_tokens"]
        await eng.generate("new", prompt, {"max_tokens": 1, "ignore_eos": True})
        new_hits = eng.stats()["prefix_cache_hit_tokens"] - before
        await eng.shutdown()
        return sibling_hits, new_hits

    assert virtual_time.run(main()) == (320, 0)


def test_only_computed_blocks_enter_the_prefix_cache():
    """A request aborted while it waits never computed its prompt: the next request with that
    prompt prefills all of it (it used to hit every block the aborted one would have filled)."""
    prompt = list(range(10, 74))  # 4 full blocks of 16

    async def main() -> tuple[int, int]:
        config = SimEngineConfig(vocab_size=500, max_num_seqs=1, block_size=16, step_base_ms=10.0, max_steps_per_wake=1)
        eng = SimEngine(config)
        await eng.start()
        first = asyncio.ensure_future(eng.generate("A", [7] * 32, {"max_tokens": 20, "ignore_eos": True}))
        await asyncio.sleep(0.001)
        waiting = asyncio.ensure_future(eng.generate("B", prompt, {"max_tokens": 5, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        assert [r.request_id for r in eng._waiting] == ["B"]  # one slot: it never ran
        await eng.abort("B")
        await first
        assert (await waiting).stop_reason == "aborted"
        before = eng.stats()["prefix_cache_hit_tokens"]
        await eng.generate("C", prompt, {"max_tokens": 5, "ignore_eos": True})
        cold = eng.stats()["prefix_cache_hit_tokens"] - before
        before = eng.stats()["prefix_cache_hit_tokens"]
        await eng.generate("D", prompt, {"max_tokens": 5, "ignore_eos": True})  # C computed it: cached now
        warm = eng.stats()["prefix_cache_hit_tokens"] - before
        await eng.shutdown()
        return cold, warm

    assert virtual_time.run(main()) == (0, 64)


@pytest.mark.parametrize("steps_per_wake", [1, 10_000])
def test_a_step_stopped_by_a_weight_load_leaves_its_prefill_to_pay(steps_per_wake):
    """A keep commit lands mid-way through the step that admits a 1,000-token prompt: that step
    never ends, so the step after the load pays the prefill (it used to be lost: the request was
    marked prefilled and finished 1 s of simulated work early)."""

    async def main(commit: bool) -> tuple[float, float]:
        config = SimEngineConfig(
            vocab_size=500, step_base_ms=10.0, step_per_seq_ms=0.0, prefill_per_token_ms=1.0,
            weight_load_ms=2000.0, max_steps_per_wake=steps_per_wake,
        )  # fmt: skip
        eng = SimEngine(config)
        await eng.start()
        sent = asyncio.ensure_future(eng.generate("A", [5] * 1000, {"max_tokens": 10, "ignore_eos": True}))
        await asyncio.sleep(0.5)  # half-way through the 1.01 s admission step
        if commit:
            await eng.stage_weights({"w": 1}, 1)
            await eng.commit_weights(1, mode="keep")
        assert len((await sent).token_ids) == 10
        busy, done = eng.stats()["sim_busy_s"], asyncio.get_running_loop().time()
        await eng.shutdown()
        return round(busy, 6), round(done, 6)

    assert virtual_time.run(main(False)) == (1.1, 1.1)
    # 0.5 s of the stopped step, the 2 s load, then the whole step again and nine more
    assert virtual_time.run(main(True)) == (1.1, 3.6)


@pytest.mark.parametrize("per_wake", [1, 1000])
def test_a_resumed_response_keeps_the_rest_of_its_drawn_length(per_wake):
    """A client resumes an aborted response with the prompt plus its tokens: the engine goes on
    with the rest of the length drawn for it (a model continues its own text), so aborts do not
    make responses longer than the lengths a plan was given. A fresh draw made this 128 tokens."""

    async def main() -> tuple[int, str, int, str]:
        eng = await started(response_lengths=[100], max_steps_per_wake=per_wake, time_scale=1.0)
        prompt = [5, 6, 7, 8]
        call = asyncio.ensure_future(eng.generate("a", prompt, {"max_tokens": 500}))
        await asyncio.sleep(0.2)  # virtual seconds: some steps, not 100
        await eng.abort("a")
        first = await call
        assert 0 < len(first.token_ids) < 100
        rest = await eng.generate("a-2", prompt + first.token_ids, {"max_tokens": 500 - len(first.token_ids)})
        again = await eng.generate("b", prompt + first.token_ids + [9], {"max_tokens": 500})  # not a resume
        await eng.shutdown()
        return len(first.token_ids) + len(rest.token_ids), rest.stop_reason, len(again.token_ids), first.stop_reason

    total, reason, fresh, first_reason = virtual_time.run(main())
    assert first_reason == "aborted" and (total, reason) == (100, "stop")
    assert fresh == 100  # another prompt draws its own length


@pytest.mark.parametrize("per_wake", [1, 1000])
def test_a_stop_sampled_as_the_last_token_the_budget_allows_is_a_stop(per_wake):
    """vLLM reports ``stop`` when the end-of-sequence token is the last one ``max_tokens`` allows;
    the sim said ``length``, which RL code penalises or filters as truncated."""

    async def main() -> list[tuple[int, str]]:
        eng = await started(response_lengths=[50], max_steps_per_wake=per_wake)
        outs = [await eng.generate(f"r{m}", [5, 6, 7], {"max_tokens": m}) for m in (49, 50, 51)]
        await eng.shutdown()
        return [(len(o.token_ids), o.stop_reason) for o in outs]

    assert virtual_time.run(main()) == [(49, "length"), (50, "stop"), (50, "stop")]
