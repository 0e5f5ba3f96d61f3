"""The sim engine's fast-forward (``max_steps_per_wake`` > 1) must be the same engine, faster: the
same tokens, logprobs, versions, stop reasons, preemptions and step ends as one step at a time,
whatever arrives, aborts, pauses or commits mid-way."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollfleet.config import SimEngineConfig
from rollfleet.engines.sim import SimEngine
from rollfleet.engines.sim.batch import _Request
from rollfleet.engines.sim.tokens import tokens
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


async def _request(prompt, max_tokens, *, stop_ids=(), ignore_eos=False, target_len=50, scripted=None):
    req = _Request("r", list(prompt), max_tokens)
    req.stop_ids = frozenset(stop_ids)
    req.ignore_eos = ignore_eos
    req.target_len = target_len
    req.token_seed = random.Random(len(prompt) * 7 + max_tokens).getrandbits(64)
    req.scripted = scripted
    return req


@pytest.mark.parametrize(
    "stop_ids, ignore_eos, scripted",
    [((), False, None), ((3, 4, 7), False, None), ((3, 4), True, None), ((), False, [5, 9, 2, 11] * 30)],
)
def test_tokens_made_at_once_equal_tokens_made_one_by_one(stop_ids, ignore_eos, scripted):
    # A tiny vocabulary makes the ids to avoid (eos 2, the stop ids) come up often.
    engine = SimEngine(SimEngineConfig(vocab_size=16, eos_token_id=2))

    async def check():
        req = await _request([1, 2, 3], 120, stop_ids=stop_ids, ignore_eos=ignore_eos, target_len=90, scripted=scripted)
        ids, logprobs = tokens(req, 0, 100, 16, 2)
        one_by_one = []
        for _ in range(100):
            tok, lp = engine._next_token(req)
            req.generated.append(tok)
            one_by_one.append((tok, lp))
        assert list(zip(ids, logprobs)) == one_by_one
        # in pieces from any start (a fast-forward produces what it counted since the last wake),
        # across the drawn end (target_len 90: position 89 is the end, those after it too)
        pieces = [tokens(req, a, b - a, 16, 2) for a, b in ((0, 37), (37, 89), (89, 90), (90, 95), (95, 100))]
        assert [t for p in pieces for t in zip(*p)] == one_by_one

    virtual_time.run(check())


async def _workload(max_steps_per_wake: int, seed: int) -> dict:
    """Arrivals, aborts, a pause, keep and abort commits and a full KV cache, on one engine."""
    cfg = SimEngineConfig(
        vocab_size=500,
        mean_response_tokens=120,
        response_sigma=1.0,
        max_num_seqs=24,
        kv_capacity_tokens=3_000,  # too small for everything at once: preemptions happen
        block_size=16,
        step_per_context_token_ms=0.0002,
        weight_load_ms=30.0,
        cache_on_prefill=True,
        max_steps_per_wake=max_steps_per_wake,
        seed=seed,
    )
    engine = SimEngine(cfg)
    await engine.start()
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    results: dict[str, tuple] = {}

    async def one(i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        prompt = [1 + (i % 5)] * 64 + [rng.randrange(3, 500) for _ in range(rng.randrange(8, 200))]
        params = {"max_tokens": rng.choice([40, 300, 900]), "seed": i, "stop_token_ids": [7]}
        out = await engine.generate(f"r{i}", prompt, params)
        results[f"r{i}"] = (
            out.token_ids,
            out.log_probs,
            out.token_versions,
            out.stop_reason,
            out.num_preempted,
            round(loop.time(), 9),
        )

    async def control() -> None:
        await asyncio.sleep(0.35)
        await engine.abort("r3")
        await engine.abort("r17")
        await asyncio.sleep(0.2)
        await engine.stage_weights({"w": 1}, 1)
        await engine.commit_weights(1, mode="keep")
        await asyncio.sleep(0.4)
        await engine.load()  # a reader settles what ended, changes nothing
        await engine.stage_weights({"w": 2}, 2)
        await engine.commit_weights(2, mode="keep")
        await asyncio.sleep(2.0)
        await engine.pause()
        await asyncio.sleep(0.05)
        await engine.resume()

    tasks = [asyncio.ensure_future(one(i, rng.random() * 3.0)) for i in range(60)]
    await control()
    await asyncio.gather(*tasks)
    stats = engine.stats()
    await engine.shutdown()
    return {"results": results, "stats": stats}


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_forward_is_the_same_engine_as_one_step_at_a_time(seed):
    stepped = virtual_time.run(_workload(1, seed))
    fast = virtual_time.run(_workload(10_000, seed))
    assert stepped["stats"]["num_preemptions"] > 0 and stepped["stats"]["num_aborted"] > 0
    assert {r[3] for r in stepped["results"].values()} >= {"stop", "length", "aborted"}
    assert fast["results"].keys() == stepped["results"].keys()
    for rid, want in stepped["results"].items():
        got = fast["results"][rid]
        assert got[:5] == want[:5], rid
        assert got[5] == pytest.approx(want[5], abs=1e-6), rid
    for key in ("generation_tokens", "num_steps", "num_preemptions", "prefix_cache_hit_tokens", "num_finished"):
        assert fast["stats"][key] == stepped["stats"][key], key
    assert fast["stats"]["num_wakes"] * 2 < stepped["stats"]["num_wakes"]
    assert fast["stats"]["sim_busy_s"] == pytest.approx(stepped["stats"]["sim_busy_s"], rel=1e-9)


def test_a_result_reaches_its_caller_request_overhead_ms_late_but_its_slot_is_free_at_once():
    async def finish_times(overhead_ms: float) -> dict[str, float]:
        cfg = SimEngineConfig(
            vocab_size=500,
            max_num_seqs=1,  # one slot: r1 waits for r0
            step_base_ms=10.0,
            prefill_per_token_ms=0.0,
            request_overhead_ms=overhead_ms,
            max_steps_per_wake=10_000,
        )
        engine = SimEngine(cfg)
        await engine.start()
        loop = asyncio.get_running_loop()
        done: dict[str, float] = {}
        params = {"max_tokens": 10, "ignore_eos": True}

        async def plain(rid: str) -> None:
            out = await engine.generate(rid, [5] * 16, {**params, "seed": 1})
            assert len(out.token_ids) == 10
            done[rid] = loop.time()

        async def streamed(rid: str) -> None:
            items = []
            async for item in engine.generate_stream(rid, [6] * 16, {**params, "seed": 2}):
                items.append(item)
                done[rid] = loop.time()  # the last: the final output
            assert len(items[-1].token_ids) == 10 and items[-1].stop_reason == "length"

        await asyncio.gather(plain("r0"), streamed("r1"))
        await engine.shutdown()
        return done

    none, late = virtual_time.run(finish_times(0.0)), virtual_time.run(finish_times(50.0))
    assert none["r1"] > none["r0"] > 0
    # each result arrives 50 ms late; r1 took r0's slot when r0 ended, not when r0's result arrived
    assert late["r0"] - none["r0"] == pytest.approx(0.05)
    assert late["r1"] - none["r1"] == pytest.approx(0.05)


def test_a_one_step_wake_counts_its_tokens_instead_of_producing_every_sequences(monkeypatch):
    """Sequences ending one step apart make one-step wakes; those are counted like any
    fast-forward, so each request's tokens are produced once, when it ends (emitting the step
    would produce every running sequence's tokens so far, at every such wake)."""
    produced: list[tuple[str, int]] = []
    materialize = SimEngine._materialize

    def counting(self, req):
        if req.pending:
            produced.append((req.request_id, req.pending))
        materialize(self, req)

    monkeypatch.setattr(SimEngine, "_materialize", counting)

    async def run() -> list[int]:
        engine = SimEngine(SimEngineConfig(vocab_size=500, max_num_seqs=8, max_steps_per_wake=10_000))
        await engine.start()
        params = {"ignore_eos": True, "seed": 1}
        outs = await asyncio.gather(
            *(engine.generate(f"r{n}", [5] * 16, {**params, "max_tokens": n}) for n in (10, 11, 12, 40))
        )
        await engine.shutdown()
        return [len(o.token_ids) for o in outs]

    assert virtual_time.run(run()) == [10, 11, 12, 40]
    assert sorted(produced) == [("r10", 10), ("r11", 11), ("r12", 12), ("r40", 40)]


@pytest.mark.parametrize("steps_per_wake", [1, 10_000])
def test_an_engine_restarted_after_a_shutdown_mid_run_counts_only_the_steps_it_takes(steps_per_wake):
    async def main() -> tuple[dict, dict]:
        engine = SimEngine(
            SimEngineConfig(
                vocab_size=500, step_base_ms=10.0, step_per_seq_ms=0, prefill_per_token_ms=0,
                max_steps_per_wake=steps_per_wake,
            )
        )  # fmt: skip
        await engine.start()
        long = asyncio.ensure_future(engine.generate("a", [5] * 16, {"max_tokens": 1000, "ignore_eos": True}))
        await asyncio.sleep(0.105)  # ten steps into a thousand
        await engine.shutdown()
        await asyncio.gather(long, return_exceptions=True)
        before = engine.stats()
        await asyncio.sleep(20.0)
        await engine.start()
        await engine.generate("b", [6] * 16, {"max_tokens": 10, "ignore_eos": True})
        after = engine.stats()
        await engine.shutdown()
        return before, after

    before, after = virtual_time.run(main())
    # the ten steps taken before the shutdown count in both loops (a fast-forward dropped them)
    assert before["num_steps"] == 10 and before["sim_busy_s"] == pytest.approx(0.1)
    assert after["num_steps"] == before["num_steps"] + 10
    assert after["sim_busy_s"] == pytest.approx(before["sim_busy_s"] + 0.1)


def test_a_prefill_cut_short_by_a_shutdown_is_not_cached_after_the_restart():
    """A request aborted during its prefill step waits for that step's end to be cached; a
    shutdown cancels the step, yet after a restart the first step of another request cached the
    aborted prompt's blocks: a later request hit all 256 tokens that were never computed."""

    async def main() -> int:
        engine = SimEngine(
            SimEngineConfig(vocab_size=500, step_base_ms=1.0, prefill_per_token_ms=1.0, max_steps_per_wake=10_000)
        )
        await engine.start()
        prompt = list(range(10, 266))
        cut = asyncio.ensure_future(engine.generate("a", prompt, {"max_tokens": 5}))
        await asyncio.sleep(0.05)  # inside its 257 ms prefill step
        await engine.abort("a")
        await asyncio.gather(cut, return_exceptions=True)
        await engine.shutdown()
        await engine.start()
        await engine.generate("other", [7] * 16, {"max_tokens": 2})
        hits = engine.stats()["prefix_cache_hit_tokens"]
        await engine.generate("again", prompt, {"max_tokens": 2})
        hit = engine.stats()["prefix_cache_hit_tokens"] - hits
        await engine.shutdown()
        return hit

    assert virtual_time.run(main()) == 0


@pytest.mark.parametrize("steps_per_wake", [1, 10_000])
def test_a_request_arriving_exactly_at_a_step_end_waits_for_the_next_step_in_both_loops(steps_per_wake):
    """On a virtual clock events land exactly on step ends (round step costs, a client answering a
    finished request at once). A step ending exactly now is still in progress to a new arrival, as
    one step at a time: the arrival joins the step after it (fast-forward counted the step as
    ended and admitted it one step later than the stepped engine)."""
    step = 1 / 128  # exact in binary: step ends are exact multiples

    async def main() -> float:
        engine = SimEngine(
            SimEngineConfig(
                vocab_size=500, step_base_ms=step * 1000, step_per_seq_ms=0.0, prefill_per_token_ms=0.0,
                max_steps_per_wake=steps_per_wake,
            )
        )  # fmt: skip
        await engine.start()
        loop = asyncio.get_running_loop()
        other = asyncio.ensure_future(engine.generate("c", [7] * 16, {"max_tokens": 50, "ignore_eos": True}))
        await asyncio.sleep(10 * step)  # exactly the end of c's tenth step
        arrived = loop.time()
        await engine.generate("b", [6] * 16, {"max_tokens": 3, "ignore_eos": True})
        took = (loop.time() - arrived) / step
        await other
        await engine.shutdown()
        return took

    assert virtual_time.run(main()) == pytest.approx(3)
