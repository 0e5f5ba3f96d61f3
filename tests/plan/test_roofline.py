"""Engine costs from the model size, the accelerator and TP (``rollfleet.plan.roofline``)."""

from __future__ import annotations

import argparse

import pytest

from rollfleet.cli.plan import add_arguments, overrides_from_args
from rollfleet.plan.profiles import load_profile
from rollfleet.plan.roofline import accelerator, engine_costs

pytestmark = pytest.mark.unit


def test_a_7b_model_on_one_h100_comes_out_at_the_published_numbers():
    published = load_profile("h100-7b")  # not derived from the roofline: from published numbers
    costs = engine_costs(7.0, accelerator("h100"), kv_bytes_per_token=524_288)  # no GQA, as the profile
    for key in ("step_base_ms", "prefill_per_token_ms", "kv_capacity_tokens"):
        assert costs[key] == pytest.approx(published[key], rel=0.15), key
    # the profile reads KV at the peak bandwidth, the roofline at 60% of it
    assert costs["step_per_context_token_ms"] == pytest.approx(published["step_per_context_token_ms"] / 0.6, rel=0.1)


def test_tensor_parallelism_splits_the_weights_the_flops_and_adds_memory():
    one = engine_costs(70.0, accelerator("h100"), tp=4)
    two = engine_costs(70.0, accelerator("h100"), tp=8)
    assert two["step_base_ms"] == pytest.approx(one["step_base_ms"] / 2)
    assert two["prefill_per_token_ms"] == pytest.approx(one["prefill_per_token_ms"] / 2)
    assert two["kv_capacity_tokens"] > 2 * one["kv_capacity_tokens"]  # the weights take less of each device
    # a faster memory makes decode cheaper, a slower chip makes prefill dearer
    h20 = engine_costs(7.0, accelerator("h20"))
    h100 = engine_costs(7.0, accelerator("h100"))
    assert h20["step_base_ms"] < h100["step_base_ms"] and h20["prefill_per_token_ms"] > 5 * h100["prefill_per_token_ms"]


def test_a_model_too_large_for_its_devices_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"params_b: 70B parameters .* tp=1 x h100"):
        engine_costs(70.0, accelerator("h100"), tp=1)
    with pytest.raises(ValueError, match="accelerator 'tpu9' is not known"):
        accelerator("tpu9")
    with pytest.raises(ValueError, match="kv_bytes_per_token must be > 0"):
        engine_costs(7.0, accelerator("h100"), kv_bytes_per_token=0)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--gpus", "16", *argv])


def test_plan_flags_price_the_engines_and_the_learner_from_the_model_unless_a_profile_prices_the_engines():
    out = overrides_from_args(_args("--model-params-b", "7", "--accelerator", "h20", "--tp", "2"))
    assert out["rollout.sim.step_base_ms"] == pytest.approx(engine_costs(7, accelerator("h20"), tp=2)["step_base_ms"])
    # the learner trains on all 16 H20s at their 148 TFLOPS
    assert out["trainer.sim_learner.seconds_per_token"] == pytest.approx(6 * 7e9 / (16 * 148e12 * 0.35))
    with_profile = overrides_from_args(_args("--model-params-b", "7", "--profile", "h100-7b"))
    assert with_profile["rollout.sim.step_base_ms"] == load_profile("h100-7b")["step_base_ms"]


def test_model_layers_and_hidden_price_attention_in_training():
    out = overrides_from_args(_args("--model-params-b", "7", "--model-layers", "28", "--model-hidden", "3584"))
    per_pair = out["trainer.sim_learner.seconds_per_token_squared"]
    assert per_pair == pytest.approx(6 * 28 * 3584 / (16 * 989e12 * 0.35))
    # a 28K-token sample: attention adds about 40% to what its tokens cost in the weights' FLOPs
    linear = 28_672 * out["trainer.sim_learner.seconds_per_token"]
    assert 0.3 < 28_672**2 * per_pair / linear < 0.5
    assert "trainer.sim_learner.seconds_per_token_squared" not in overrides_from_args(_args("--model-params-b", "7"))
