"""Engine costs from the model size, the accelerator and TP (``rollfleet.plan.roofline``)."""

from __future__ import annotations

import argparse

import pytest

from rollfleet.cli.plan import add_arguments, overrides_from_args
from rollfleet.plan.profiles import load_profile
from rollfleet.plan.roofline import accelerator, allreduce_us, engine_costs, model_shape

pytestmark = pytest.mark.unit


# no all-reduce latency, and links no message waits for
FREE_LINKS = {"allreduce_latency_us": 0.0, "allreduce_link_efficiency": 1e9, "allreduce_large_link_efficiency": 1e9}


def test_a_7b_model_on_one_h100_comes_out_at_the_published_numbers():
    published = load_profile("h100-7b")  # not derived from the roofline: from published numbers
    costs = engine_costs(7.0, accelerator("h100"), kv_bytes_per_token=524_288)  # no GQA, as the profile
    for key in ("step_base_ms", "prefill_per_token_ms", "kv_capacity_tokens"):
        assert costs[key] == pytest.approx(published[key], rel=0.15), key
    # the profile reads KV at the peak bandwidth, the roofline at 60% of it
    assert costs["step_per_context_token_ms"] == pytest.approx(published["step_per_context_token_ms"] / 0.6, rel=0.1)


def test_tensor_parallelism_splits_the_weights_the_flops_and_adds_memory():
    # without the all-reduces' cost, TP divides exactly
    one = engine_costs(70.0, accelerator("h100"), tp=4, **FREE_LINKS)
    two = engine_costs(70.0, accelerator("h100"), tp=8, **FREE_LINKS)
    assert two["step_base_ms"] == pytest.approx(one["step_base_ms"] / 2)
    assert two["prefill_per_token_ms"] == pytest.approx(one["prefill_per_token_ms"] / 2, rel=1e-3)
    assert two["kv_capacity_tokens"] > 2 * one["kv_capacity_tokens"]  # the weights take less of each device
    # a faster memory makes decode cheaper, a slower chip makes prefill dearer
    h20 = engine_costs(7.0, accelerator("h20"))
    h100 = engine_costs(7.0, accelerator("h100"))
    assert h20["step_base_ms"] < h100["step_base_ms"] and h20["prefill_per_token_ms"] > 5 * h100["prefill_per_token_ms"]


# vLLM's custom all-reduce on H100, without CUDA graphs, microseconds (SGLang pull request 2904):
# message bytes -> (tp 2, tp 4, tp 8)
PUBLISHED_ALLREDUCE_US = {
    512: (9.5, 9.1, 10.1),
    4096: (8.8, 8.5, 9.3),
    32768: (8.7, 9.2, 11.8),
    262144: (12.9, 20.6, 24.1),
    524288: (17.7, 26.9, 30.4),
    1048576: (26.6, 40.2, 45.0),
}


def test_an_all_reduce_costs_what_vllm_published_for_h100_at_tp_2_4_and_8():
    h100 = accelerator("h100")
    ratios = [
        allreduce_us(nbytes, tp, h100) / us
        for nbytes, row in PUBLISHED_ALLREDUCE_US.items()
        for tp, us in zip((2, 4, 8), row)
    ]
    assert all(0.7 <= r <= 1.3 for r in ratios), [round(r, 2) for r in ratios]
    assert sorted(ratios)[len(ratios) // 2] == pytest.approx(1.0, abs=0.1)
    assert allreduce_us(1 << 20, 1, h100) == 0.0  # one device: nothing to reduce


def test_tensor_parallelism_pays_two_all_reduces_a_layer_in_every_step():
    h100 = accelerator("h100")
    shape = {"layers": 28, "hidden": 3584}  # Qwen2.5-7B
    one = engine_costs(7.0, h100, tp=1, **shape)
    free = engine_costs(7.0, h100, tp=4, **FREE_LINKS, **shape)
    four = engine_costs(7.0, h100, tp=4, **shape)
    assert one == engine_costs(7.0, h100, tp=1)  # at tp=1 the shape costs nothing
    # the latency of 56 all-reduces a step, and each token's activations through the ring
    assert four["step_base_ms"] - free["step_base_ms"] == pytest.approx(56 * 9.0e-3)
    decode_token_ms = four["step_per_seq_ms"] - free["step_per_seq_ms"]
    assert decode_token_ms == pytest.approx(56 * 1.5 * 3584 * 2 / (450e9 * 0.12) * 1e3)
    # a prefill's large messages move at a far larger share of the link than a decode step's
    prefill_token_ms = four["prefill_per_token_ms"] - free["prefill_per_token_ms"]
    assert prefill_token_ms == pytest.approx(56 * 1.5 * 3584 * 2 / (450e9 * 0.7) * 1e3)
    # so a 7B decode step at tp=8 no longer gets twice as fast as at tp=4: the all-reduces don't split
    eight = engine_costs(7.0, h100, tp=8, **shape)
    assert eight["step_base_ms"] > 0.6 * four["step_base_ms"]
    assert eight["step_per_seq_ms"] > four["step_per_seq_ms"]


def test_the_shape_of_a_model_nobody_described_is_estimated_from_its_size():
    assert model_shape(7.0) == (33, 4224)  # Llama-2-7B: 32 x 4,096
    layers, hidden = model_shape(70.0)  # Llama-70B: 80 x 8,192
    assert layers * hidden == pytest.approx(80 * 8192, rel=0.02)
    h100 = accelerator("h100")
    assert engine_costs(7.0, h100, tp=2) == engine_costs(7.0, h100, tp=2, layers=33, hidden=4224)
    with pytest.raises(ValueError, match="layers must be >= 1, got 0"):
        engine_costs(7.0, h100, tp=2, layers=0)


def test_a_model_too_large_for_its_devices_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"params_b: 70B parameters .* tp=1 x h100"):
        engine_costs(70.0, accelerator("h100"), tp=1)
    with pytest.raises(ValueError, match="accelerator 'tpu9' is not known"):
        accelerator("tpu9")
    with pytest.raises(ValueError, match="kv_bytes_per_token must be a finite number > 0"):
        engine_costs(7.0, accelerator("h100"), kv_bytes_per_token=0)
    with pytest.raises(ValueError, match="params_b must be a finite number > 0, got nan"):
        engine_costs(float("nan"), accelerator("h100"))  # was int(NaN) deep in the capacity
    # the weights fit; a KV size no cache holds is what is named, not the model's size
    with pytest.raises(ValueError, match=r"kv_bytes_per_token: 1e\+11 bytes a token leave no room"):
        engine_costs(7.0, accelerator("h100"), kv_bytes_per_token=100_000_000_000)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--gpus", "16", *argv])


def test_plan_flags_price_the_engines_and_the_learner_from_the_model_unless_a_profile_prices_the_engines():
    out = overrides_from_args(_args("--model-params-b", "7", "--accelerator", "h20", "--tp", "2"))
    assert out["rollout.sim.step_base_ms"] == pytest.approx(engine_costs(7, accelerator("h20"), tp=2)["step_base_ms"])
    # the model's shape prices TP's all-reduces
    shaped = overrides_from_args(
        _args("--model-params-b", "7", "--tp", "2", "--model-layers", "28", "--model-hidden", "3584")
    )
    expected = engine_costs(7, accelerator("h100"), tp=2, layers=28, hidden=3584)
    assert shaped["rollout.sim.step_per_seq_ms"] == pytest.approx(expected["step_per_seq_ms"])
    estimated = overrides_from_args(_args("--model-params-b", "7", "--tp", "2"))  # 33 layers: 66 all-reduces
    assert shaped["rollout.sim.step_base_ms"] < estimated["rollout.sim.step_base_ms"]
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
