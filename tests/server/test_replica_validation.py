"""Bad input fails alone with the field named; the replica keeps serving everyone else."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.errors import InvalidRequest, NoServerAvailable, NotSupported, ReplicaUnavailable
from rollfleet.server.replica import Replica
from rollfleet.types import TokenOutput

pytestmark = pytest.mark.unit


async def replica(**kw) -> Replica:
    cfg = RolloutConfig(
        name="sim",
        prompt_length=64,
        response_length=32,
        max_model_len=128,
        sim=SimEngineConfig(vocab_size=500, time_scale=1000.0, mean_response_tokens=20),
        **kw,
    )
    r = Replica("r0", cfg, 0)
    await r.start(version=0)
    return r


BAD = [
    ([], {}, "prompt_ids", "at least 1 token"),
    ("hello", {}, "prompt_ids", "list of token ids"),
    ([1, 2, 500], {}, "prompt_ids[2]", "vocab_size (500)"),
    ([1, -1], {}, "prompt_ids[1]", "0 <= id"),
    ([1, 2.5], {}, "prompt_ids[1]", "integer"),
    (list(range(1, 129)), {}, "prompt_ids", "max_model_len (128)"),
    ([1] * 100, {"max_tokens": 40}, "sampling_params.max_tokens", "max_model_len (128)"),
    ([1], {"max_tokens": -3}, "sampling_params.max_tokens", ">= 1"),
    ([1], {"max_tokens": "5"}, "sampling_params.max_tokens", "integer"),
    ([1], {"max_new_tokens": 0}, "sampling_params.max_new_tokens", ">= 1"),
    ([1], {"temperature": -0.5}, "sampling_params.temperature", ">= 0"),
    ([1], {"top_p": 0}, "sampling_params.top_p", "> 0"),
    ([1], {"top_p": 1.5}, "sampling_params.top_p", "<= 1"),
    ([1], {"top_k": -5}, "sampling_params.top_k", "-1 or 0"),
    ([1], {"n": 4}, "sampling_params.n", "n == 1"),
    ([1], {"stop_token_ids": [9999]}, "sampling_params.stop_token_ids[0]", "vocab_size"),
    ([1], {"ignore_eos": "yes"}, "sampling_params.ignore_eos", "bool"),
    ([1], {"temperature": float("inf")}, "sampling_params.temperature", "finite"),  # JSON 1e999
    ([1], {"top_p": float("nan")}, "sampling_params.top_p", "finite"),
    ([1], {"temprature": 0.5}, "sampling_params.temprature", "did you mean 'temperature'"),
    ([1], {"passthrough": ["x"]}, "sampling_params.passthrough", "dict"),
    ([1], {"seed": 1, "passthrough": {"seed": 2}}, "sampling_params.passthrough.seed", "not also given"),
    # min_new_tokens (the sim engine reads it, vLLM maps it to min_tokens) was never checked
    ([1], {"min_new_tokens": "x"}, "sampling_params.min_new_tokens", "integer"),
    ([1], {"max_tokens": 8, "min_new_tokens": 10**6}, "sampling_params.min_new_tokens", "min_new_tokens <= 8"),
    ([1], {"min_tokens": 2, "min_new_tokens": 3}, "sampling_params.min_new_tokens", "equal to min_tokens"),
    ([1], {"temprature": None}, "sampling_params.temprature", "did you mean"),  # None is no pass for a typo
    # nested: refused on the Ray path as the data plane refuses them (JSON carried them as null)
    ([1], {"passthrough": {"length_penalty": float("nan")}}, "sampling_params.passthrough.length_penalty", "finite"),
    (
        [1],
        {"structured_outputs": {"choice": [1.0, float("inf")]}},
        "sampling_params.structured_outputs.choice.1",
        "finite",
    ),
    # logit_bias was never checked: an integer key failed the HTTP engines' JSON encoder (TypeError)
    ([1], {"logit_bias": {"x": 1.0}}, "sampling_params.logit_bias.x", "a token id"),
    ([1], {"logit_bias": {500: 1.0}}, "sampling_params.logit_bias.500", "[0, 500)"),
    ([1], {"logit_bias": {"3": 200}}, "sampling_params.logit_bias.3", "[-100, 100]"),
    ([1], {"logit_bias": {"3": float("nan")}}, "sampling_params.logit_bias.3", "[-100, 100]"),
    ([1], {"logit_bias": [3, 1.0]}, "sampling_params.logit_bias", "a mapping"),
    # request fields the engines send as they are: SGLang's adapter failed on "high" with a bare ValueError
    ([1], {"priority": "high"}, "sampling_params.priority", "an integer"),
    ([1], {"priority": 2.7}, "sampling_params.priority", "an integer"),
    ([1], {"cache_salt": 5}, "sampling_params.cache_salt", "a non-empty string"),
    # integers JSON cannot carry (orjson: a bare TypeError in an engine's encoder), any key
    ([1], {"seed": 2**70}, "sampling_params.seed", "64 bits"),
    ([1], {"priority": -(2**64)}, "sampling_params.priority", "64 bits"),
    ([1], {"top_k": 2**64}, "sampling_params.top_k", "64 bits"),
    # sampling_seed (vLLM's seed, by its sim-engine name) was never checked; scalars of keys with no
    # check of their own passed NaN and infinity through Ray (the data plane refused them)
    ([1], {"sampling_seed": "abc"}, "sampling_params.sampling_seed", "an integer"),
    ([1], {"prompt_logprobs": float("nan")}, "sampling_params.prompt_logprobs", "finite"),
    ([1], {"truncate_prompt_tokens": float("inf")}, "sampling_params.truncate_prompt_tokens", "finite"),
]


async def test_a_parameter_given_as_none_is_one_not_given():
    """As JSON's null at the gateway: the sim engine read ``temperature: None`` and failed on it
    with a TypeError naming nothing."""
    r = await replica()
    out = await r.generate("n", [1, 2], {"max_tokens": 4, "ignore_eos": True, "temperature": None, "top_p": None})
    assert len(out.token_ids) == 4
    await r.shutdown()


async def test_engine_specific_keys_travel_under_passthrough():
    r = await replica()
    seen = {}
    generate = r.engine.generate

    async def spy(request_id, prompt_ids, params, **kw):
        seen.update(params)
        return await generate(request_id, prompt_ids, params, **kw)

    r.engine.generate = spy
    await r.generate("p", [1, 2], {"max_tokens": 2, "passthrough": {"my_engine_knob": 3}})
    assert seen["my_engine_knob"] == 3 and "passthrough" not in seen
    # logit_bias keys go as strings: vLLM's own SamplingParams takes ints, JSON (the HTTP engines'
    # encoding) strings only, and an int key was a bare TypeError in the engine, named nowhere
    await r.generate("b", [1, 2], {"max_tokens": 2, "logit_bias": {3: 5, "7": -1.5}})
    assert seen["logit_bias"] == {"3": 5.0, "7": -1.5}
    await r.shutdown()


@pytest.mark.parametrize("prompt,params,field,limit", BAD)
async def test_bad_input_names_field_and_limit(prompt, params, field, limit):
    r = await replica()
    with pytest.raises(InvalidRequest) as err:
        await r.generate("bad", prompt, params)
    assert err.value.field == field
    assert limit in str(err.value)
    # the replica keeps serving, and nothing leaked
    out = await r.generate("good", [1, 2, 3], {"max_tokens": 4, "ignore_eos": True})
    assert len(out.token_ids) == 4
    assert (await r.load()).inflight == 0
    await r.shutdown()


async def test_a_client_id_that_is_no_string_is_refused_and_counts_nothing():
    """``client_id`` came unchecked: a list failed with a bare TypeError after the request was
    counted in flight, and the count stayed (every router read the phantom load for good)."""
    r = await replica()
    for bad in (["c1"], {"c": 1}, 7):
        with pytest.raises(InvalidRequest) as err:
            await r.generate_with_load("bad", [1, 2, 3], {"max_tokens": 4}, client_id=bad)
        assert err.value.field == "client_id"
    with pytest.raises(InvalidRequest) as err:
        await r.generate_with_load(["not", "an", "id"], [1, 2, 3], {"max_tokens": 4})
    assert err.value.field == "request_id"
    load = await r.load()
    assert load.inflight == 0 and r._book.requests == 0 and r._book.tokens == 0
    out = await r.generate_with_load("good", [1, 2, 3], {"max_tokens": 4, "ignore_eos": True}, client_id="c1")
    assert len(out.output.token_ids) == 4 and out.load.inflight == 0
    await r.shutdown()


async def test_bad_requests_among_good_ones_concurrently():
    r = await replica()
    good = [r.generate(f"g{i}", [1, 2, 3], {"max_tokens": 8, "ignore_eos": True}) for i in range(20)]
    bad = [r.generate(f"b{i}", [10_000], {}) for i in range(20)]
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    assert all(isinstance(x, TokenOutput) and len(x.token_ids) == 8 for x in results[:20])
    assert all(isinstance(x, InvalidRequest) for x in results[20:])
    st = await r.stats()
    assert st["invalid"] == 20 and st["requests"] == 20
    await r.shutdown()


async def test_caller_params_not_mutated_and_default_budget():
    r = await replica()
    params = {"max_new_tokens": 5, "ignore_eos": True}
    out = await r.generate("a", [1, 2], params)
    assert params == {"max_new_tokens": 5, "ignore_eos": True}
    assert len(out.token_ids) == 5
    out = await r.generate("b", [1, 2], {"ignore_eos": True})
    assert len(out.token_ids) == 32  # response_length
    await r.shutdown()


async def test_version_stamps_and_syncing_replica_refuses():
    r = await replica()
    out = await r.generate("a", [1, 2], {"max_tokens": 3})
    assert out.extra_fields["global_steps"] == 0
    assert out.extra_fields["min_global_steps"] == out.extra_fields["max_global_steps"] == 0
    assert out.token_versions == [0] * len(out.token_ids)
    await r.update_weights({"w": 1}, 1)
    out = await r.generate("b", [1, 2], {"max_tokens": 3})
    assert out.extra_fields["global_steps"] == 1
    fresh = Replica("r1", r.config, 1)
    await fresh.start()  # no version: waits for the current weights
    with pytest.raises(ReplicaUnavailable, match="syncing"):
        await fresh.generate("c", [1], {"max_tokens": 2})
    await fresh.update_weights({"w": 1}, 1)
    assert (await fresh.generate("c", [1], {"max_tokens": 2})).extra_fields["global_steps"] == 1
    await r.shutdown()
    await fresh.shutdown()


async def test_update_weights_aborts_inflight_and_holds_new_requests():
    cfg = RolloutConfig(
        name="sim",
        response_length=5000,
        max_model_len=6000,
        sim=SimEngineConfig(vocab_size=500, time_scale=1.0, step_base_ms=2.0),
    )
    r = Replica("r0", cfg, 0)
    await r.start(version=0)
    inflight = asyncio.ensure_future(r.generate("a", [1, 2], {"max_tokens": 4000, "ignore_eos": True}))
    await asyncio.sleep(0.1)
    await r.pause()
    held = asyncio.ensure_future(r.generate("b", [1, 2], {"max_tokens": 3}))
    out = await inflight
    assert out.stop_reason == "aborted" and out.extra_fields["max_global_steps"] == 0
    await r.update_weights({"w": 2}, 1, resume=False)
    await asyncio.sleep(0.05)
    assert not held.done()
    await r.resume()
    assert (await held).extra_fields["min_global_steps"] == 1  # generated on the new weights only
    await r.shutdown()


async def test_an_unknown_profile_option_is_refused_by_name_and_a_known_one_works(tmp_path):
    """A profile option the engine does not take (vLLM's server would ignore it) fails, naming it
    and the nearest known one; nothing was started, and the replica profiles as asked after."""
    r = await replica()
    with pytest.raises(InvalidRequest) as err:
        await r.start_profile(trace_dri=str(tmp_path))
    assert err.value.field == "trace_dri" and "did you mean 'trace_dir'" in err.value.limit
    assert await r.stop_profile() is None  # the refused call started nothing
    await r.start_profile(trace_dir=str(tmp_path))
    await r.generate("p", [1, 2], {"max_tokens": 3})
    assert str(await r.stop_profile()).startswith(str(tmp_path))
    await r.shutdown()


def test_errors_pickle_with_their_fields():
    for err in (
        InvalidRequest("prompt_ids", "non-empty", []),
        NoServerAvailable("x"),
        ReplicaUnavailable("r0", "dead"),
        NotSupported("vllm", "sleep", "cpu"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
    assert pickle.loads(pickle.dumps(InvalidRequest("f", "l", 3))).field == "f"


def test_token_output_stop_reason_is_closed_set():
    TokenOutput(token_ids=[1], stop_reason="length")
    with pytest.raises(ValueError):
        TokenOutput(token_ids=[1], stop_reason="completed")


async def test_an_owners_resume_an_abort_commit_overtakes_serves_once_the_weights_are_in():
    """The owner's resume was on the wire (the engine had resumed, its answer not back) when an
    abort-mode commit paused the engine to load: the resume then marked the replica serving, and
    the commit, finding it so, never resumed the engine. Every request routed there hung."""
    r = await replica()
    resume = r.engine.resume

    async def answer_late() -> None:
        await resume()
        await asyncio.sleep(0.2)  # resumed; its HTTP answer still on its way back

    r.engine.resume = answer_late  # type: ignore[method-assign]
    await r.pause()
    await r.stage_weights(None, 2)
    resuming = asyncio.ensure_future(r.resume())
    await asyncio.sleep(0.05)
    await asyncio.gather(resuming, r.commit_weights(2, "abort"))
    assert r._state.value == "serving" and r._version == 2
    out = await asyncio.wait_for(r.generate("after", [1, 2, 3], {"max_tokens": 2}), 5)
    assert len(out.token_ids) >= 1
    await r.shutdown()


async def test_the_owners_pause_while_the_engine_resumes_holds():
    """An HTTP engine's resume is a network call: a pause that landed during it was lost, and the
    replica served on devices its owner (a colocated learner) had taken back."""
    r = await replica()
    resume = r.engine.resume

    async def slow_resume() -> None:
        await asyncio.sleep(0.05)
        await resume()

    r.engine.resume = slow_resume  # type: ignore[method-assign]
    await r.pause()
    resuming = asyncio.ensure_future(r.resume())
    await asyncio.sleep(0.01)
    await r.pause()
    await resuming
    assert r._state.value == "paused"
    held = asyncio.ensure_future(r.generate("held", [1, 2, 3], {"max_tokens": 2}))
    await asyncio.sleep(0.2)
    assert not held.done()  # waits at the gate
    await r.resume()
    assert len((await held).token_ids) >= 1
    await r.shutdown()


async def test_a_keep_commit_on_a_replica_its_owner_paused_loads_as_abort_and_leaves_it_paused():
    """A keep commit went to the engine whatever the owner had said: vLLM's keep commit ends by
    resuming the server's scheduler, which set generating what the paused server still held while
    a colocated learner had the devices. Paused or asleep by its owner, a replica now loads the
    abort way (nothing runs there to keep) and stays held; serving, it keeps."""
    r = await replica()
    modes: list[str] = []
    commit, resume = r.engine.commit_weights, r.engine.resume
    resumed: list[bool] = []

    async def recording(version, mode="abort"):
        modes.append(mode)
        await commit(version, mode)

    async def counting() -> None:
        resumed.append(True)
        await resume()

    r.engine.commit_weights = recording  # type: ignore[method-assign]
    r.engine.resume = counting  # type: ignore[method-assign]
    await r.pause()
    await r.stage_weights(None, 2)
    result = await r.commit_weights(2, "keep")
    assert result["mode"] == "abort" and modes == ["abort"] and not resumed
    assert r._state.value == "paused" and r._version == 2
    held = asyncio.ensure_future(r.generate("held", [1, 2, 3], {"max_tokens": 2}))
    await asyncio.sleep(0.2)
    assert not held.done()  # still held at the gate
    await r.resume()
    assert len((await held).token_ids) >= 1
    await r.stage_weights(None, 3)
    assert (await r.commit_weights(3, "keep"))["mode"] == "keep" and modes[-1] == "keep"  # serving: kept
    await r.shutdown()
