"""The sim engine's prefix cache and stop rules where weights change, the cache is reset, a
sequence is preempted or EOS is ignored: each as vLLM does it, or a plan prices work that a real
fleet would not do (or skips work it would)."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.config import SimEngineConfig
from rollfleet.engines.sim import SimEngine
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit

PROMPT = list(range(1, 101))  # six whole blocks of 16, and four tokens


async def started(**kw) -> SimEngine:
    engine = SimEngine(SimEngineConfig(**{"vocab_size": 1000, "mean_response_tokens": 50, "block_size": 16, **kw}))
    await engine.start()
    return engine


async def prefill_timed(**kw) -> SimEngine:
    """An engine whose steps cost 10 ms plus 1 ms per prefill token (a 1,000-token prefill: 1.01 s)."""
    return await started(step_base_ms=10.0, step_per_seq_ms=0.0, prefill_per_token_ms=1.0, **kw)


def hits(engine: SimEngine) -> int:
    return int(engine.stats()["prefix_cache_hit_tokens"])


def test_ignore_eos_ignores_the_eos_only_not_the_stop_token_ids():
    """With ``ignore_eos`` a stop token id was ignored too; vLLM's ``check_stop`` ends on it."""

    async def run() -> None:
        engine = await started()
        engine.script_responses(lambda rid, prompt, params: [5, 7, 9, 11])
        for spw in (1, 1000):  # the step-at-a-time loop and the fast-forward
            engine.config.max_steps_per_wake = spw
            out = await engine.generate(
                f"a{spw}", [1] * 20, {"max_tokens": 10, "ignore_eos": True, "stop_token_ids": [7]}
            )
            assert (out.token_ids, out.stop_reason) == ([5, 7], "stop")
        eos = engine.config.eos_token_id
        engine.script_responses(lambda rid, prompt, params: [5, eos, 9])
        out = await engine.generate("b", [1] * 20, {"max_tokens": 10, "ignore_eos": True})
        assert (out.token_ids, out.stop_reason) == ([5, eos, 9], "stop")  # the EOS itself is ignored
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_request_that_arrives_during_a_weight_load_misses_the_old_weights_blocks(mode):
    """It took the salt of the weights being replaced and hit their blocks (96 tokens), though
    every one of its tokens came from the new weights; rollfleet's vLLM engine holds it back and
    salts it with the new label."""

    async def run() -> None:
        engine = await started(weight_load_ms=100.0)
        await engine.generate("warm", PROMPT, {"max_tokens": 4, "ignore_eos": True})
        before = hits(engine)
        await engine.stage_weights({"w": 1}, 1)
        commit = asyncio.ensure_future(engine.commit_weights(1, mode=mode))
        await asyncio.sleep(0.01)  # the load is under way
        late = asyncio.ensure_future(engine.generate("late", PROMPT, {"max_tokens": 4, "ignore_eos": True}))
        await commit
        out = await late
        assert out.token_versions == [1, 1, 1, 1]
        assert hits(engine) == before
        again = await engine.generate("again", PROMPT, {"max_tokens": 4, "ignore_eos": True})
        assert again.token_versions == [1] * 4 and hits(engine) == before + 96  # the new weights' blocks
        await engine.shutdown()

    virtual_time.run(run())


def test_a_load_given_up_leaves_its_salt_to_no_other_weights():
    """A commit cancelled during its load (a caller's timeout): the request that arrived meanwhile
    ran on the old weights under the salt of the new ones, and the retried commit took that very
    salt: the new weights' requests hit 96 tokens the old weights computed."""

    async def run() -> None:
        engine = await started(weight_load_ms=100.0)
        await engine.stage_weights({"w": 1}, 1)
        commit = asyncio.ensure_future(engine.commit_weights(1, mode="keep"))
        await asyncio.sleep(0.01)
        early = asyncio.ensure_future(engine.generate("early", PROMPT, {"max_tokens": 4, "ignore_eos": True}))
        await asyncio.sleep(0.01)
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        assert (await early).token_versions == [None] * 4  # the old weights
        await engine.commit_weights(1, mode="keep")  # still staged: the retry loads them
        before = hits(engine)
        out = await engine.generate("new", PROMPT, {"max_tokens": 4, "ignore_eos": True})
        assert out.token_versions == [1] * 4 and hits(engine) == before
        await engine.shutdown()

    virtual_time.run(run())


def test_weights_staged_during_a_load_are_the_next_commits():
    """Staging version 2 while version 1 loads (staging drops older versions) made the load of 1
    fail at its end (KeyError), its engine left on the old weights."""

    async def run() -> None:
        engine = await started(weight_load_ms=100.0)
        await engine.stage_weights({"w": 1}, 1)
        commit = asyncio.ensure_future(engine.commit_weights(1, mode="keep"))
        await asyncio.sleep(0.01)
        await engine.stage_weights({"w": 2}, 2)
        await commit
        out = await engine.generate("a", PROMPT, {"max_tokens": 2, "ignore_eos": True})
        assert out.token_versions == [1, 1]
        await engine.commit_weights(2, mode="keep")
        out = await engine.generate("b", PROMPT, {"max_tokens": 2, "ignore_eos": True})
        assert out.token_versions == [2, 2]
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("reset", ["update_weights", "clear_kv_cache"])
def test_after_a_cache_reset_a_queued_request_does_not_find_the_blocks_of_before(reset):
    """A request running through the reset put its blocks, computed before it, back in the cache
    when it finished; a request queued before the reset carries the same salt and hit them."""

    async def run() -> None:
        engine = await started(max_num_seqs=1, step_base_ms=10.0)
        running = asyncio.ensure_future(engine.generate("a", PROMPT, {"max_tokens": 20, "ignore_eos": True}))
        queued = asyncio.ensure_future(engine.generate("b", PROMPT, {"max_tokens": 5, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        if reset == "update_weights":
            await engine.update_weights({"w": 1})
        else:
            await engine.clear_kv_cache()
        await asyncio.gather(running, queued)
        assert hits(engine) == 0
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("cache_on_prefill", [False, True])
@pytest.mark.parametrize("spw", [1, 1000])
def test_a_preempted_sequence_recomputes_only_what_left_the_cache(cache_on_prefill, spw):
    """Its blocks were freed without their hashes: the recompute prefilled its whole context again
    (0 tokens hit without cache_on_prefill, only the prompt with it), where vLLM's freed blocks
    stay cached until reused."""

    async def run() -> None:
        engine = await started(
            kv_capacity_tokens=320, max_model_len=320, cache_on_prefill=cache_on_prefill, max_steps_per_wake=spw
        )
        outs = await asyncio.gather(
            *(
                engine.generate(f"r{i}", [10 + i] * 96, {"max_tokens": 100, "ignore_eos": True, "seed": i})
                for i in (0, 1)
            )
        )
        assert [o.num_preempted for o in outs] == [0, 1]
        prompt_hits = 96 if cache_on_prefill else 0
        assert hits(engine) > prompt_hits  # its generated blocks too
        assert engine._kv_blocks_free == engine._kv_blocks_total  # nothing leaked
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("spw", [1, 1000])
def test_min_tokens_holds_back_the_eos_and_the_stop_ids(spw):
    """The sim read no ``min_tokens``: asked for at least 45 tokens, a response drawn short
    stopped at its EOS after 26 (vLLM masks the EOS and the stop ids until then)."""

    async def run() -> None:
        engine = await started(mean_response_tokens=5, max_steps_per_wake=spw)
        short = await engine.generate("short", [1] * 20, {"max_tokens": 50, "seed": 3})
        assert short.stop_reason == "stop" and len(short.token_ids) < 45
        held = await engine.generate("held", [1] * 20, {"max_tokens": 50, "min_tokens": 45, "seed": 3})
        eos = engine.config.eos_token_id
        assert (len(held.token_ids), held.token_ids[-1], held.stop_reason) == (46, eos, "stop")
        assert eos not in held.token_ids[:-1]
        alias = await engine.generate("alias", [1] * 20, {"max_tokens": 50, "min_new_tokens": 45, "seed": 3})
        assert alias.token_ids == held.token_ids
        engine.script_responses(lambda rid, prompt, params: [5, 7, 9, 7, 13])
        out = await engine.generate("scripted", [1] * 20, {"max_tokens": 10, "min_tokens": 2, "stop_token_ids": [7]})
        assert (out.token_ids, out.stop_reason) == ([5, 7, 9, 7], "stop")  # the first 7 came too soon
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("spw", [1, 1000])
@pytest.mark.parametrize("cache_on_prefill", [False, True])
@pytest.mark.parametrize("resume_after_s", [1.0, 0.1])
def test_a_prefill_is_cached_only_if_its_step_ran(resume_after_s, cache_on_prefill, spw):
    """A pause half-way through a request's first step aborts it. Resumed after that step's end,
    the step is thrown away (never billed), but the request's prompt blocks were cached all the
    same: the next request with that prompt hit 992 of 1,000 tokens nobody computed, a second of
    prefill gone from the plan. Resumed before, the step runs on (billed, as in vLLM, where a
    step in progress ends), and what it computed is cached."""

    async def run() -> None:
        engine = await prefill_timed(cache_on_prefill=cache_on_prefill, max_steps_per_wake=spw)
        prompt = [5] * 1000
        first = asyncio.ensure_future(engine.generate("a", prompt, {"max_tokens": 10, "ignore_eos": True}))
        await asyncio.sleep(0.5)  # half-way through its 1.01 s prefill step
        await engine.pause()
        assert (await first).token_ids == []
        await asyncio.sleep(resume_after_s)
        await engine.resume()
        ran = resume_after_s < 0.5
        await engine.generate("b", prompt, {"max_tokens": 10, "ignore_eos": True})
        # b: its prefill (all of it, or the 8 tokens past the cached blocks), then nine decodes
        assert hits(engine) == (992 if ran else 0)
        busy = (1.01 + 0.018 + 0.09) if ran else (1.01 + 0.09)
        assert engine.stats()["sim_busy_s"] == pytest.approx(busy)
        await engine.generate("c", prompt, {"max_tokens": 10, "ignore_eos": True})
        assert hits(engine) == (992 if ran else 0) + 992  # what b computed is cached
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("spw", [1, 1000])
@pytest.mark.parametrize("resume_after_s", [1.0, 0.1])
def test_siblings_sharing_a_prefill_cache_it_only_if_its_step_ran(resume_after_s, spw):
    """Two requests of one prompt admitted together: the second hits the first's blocks while the
    first's prefill computes them (as in vLLM). A pause half-way through that step aborts both; the
    second, whose whole context had hit, left its blocks cached as if computed, and with the step
    thrown away a third request hit 992 tokens nobody computed."""

    async def run() -> None:
        engine = await prefill_timed(cache_on_prefill=True, max_steps_per_wake=spw)
        prompt = [5] * 992  # whole blocks: the sibling's context hits whole
        params = {"max_tokens": 10, "ignore_eos": True}
        both = [asyncio.ensure_future(engine.generate(f"s{i}", prompt, params)) for i in range(2)]
        await asyncio.sleep(0.5)  # half-way through their 1.002 s prefill step
        await engine.pause()
        assert [(await f).token_ids for f in both] == [[], []]
        assert hits(engine) == 992  # the sibling's, on the first's blocks in flight
        await asyncio.sleep(resume_after_s)
        await engine.resume()
        ran = resume_after_s < 0.5
        await engine.generate("c", prompt, params)
        assert hits(engine) == 992 + (992 if ran else 0)
        await engine.shutdown()

    virtual_time.run(run())


@pytest.mark.parametrize("spw", [1, 1000])
def test_a_request_aborted_while_its_engine_hangs_after_a_thrown_away_step_caches_nothing(spw):
    """Its prefill's step was thrown away by the hang; aborted while the engine still hung (no step
    running), it was queued to be cached when the next step ended, which was someone else's."""

    async def run() -> None:
        engine = await prefill_timed(max_steps_per_wake=spw)
        prompt = [5] * 1000
        first = asyncio.ensure_future(engine.generate("a", prompt, {"max_tokens": 10, "ignore_eos": True}))
        await asyncio.sleep(0.5)
        engine.inject_fault("hang")
        await asyncio.sleep(1.0)  # past the step's end: thrown away
        await engine.abort("a")
        assert (await first).token_ids == []
        engine.inject_fault("none")
        await engine.generate("b", [9] * 100, {"max_tokens": 2, "ignore_eos": True})
        await engine.generate("c", prompt, {"max_tokens": 2, "ignore_eos": True})
        assert hits(engine) == 0
        await engine.shutdown()

    virtual_time.run(run())
