"""Engine step costs from the model size, the accelerator and tensor parallelism: a roofline.

For a plan of a model or an accelerator nobody has calibrated (``rollfleet calibrate`` measures a
real engine; this estimates one). A decode step streams every weight from memory once (the step's
fixed cost) and reads every running sequence's KV cache (its cost per token of context); a
prefill computes 2 FLOPs per parameter per prompt token; the KV cache gets the memory the weights
leave. Tensor parallelism splits the weights, the KV cache and the FLOPs over ``tp`` devices.
Efficiencies are what a serving engine reaches, not peaks: with the defaults, a 7B model in bf16
on one H100 comes out at the published numbers the sim engine's defaults were taken from
(``profiles/h100-7b.yaml``: ~7 ms a step, ~25k prefill tokens/s).

Not modelled: the all-reduces tensor parallelism adds to every layer, attention FLOPs in prefill
(quadratic in the prompt), and the per-sequence cost (sampling, scheduling), which is a constant
(``per_seq_ms``) rather than derived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Accelerator:
    name: str
    tflops: float  # dense bf16 peak
    hbm_tbps: float  # memory bandwidth
    hbm_gib: float  # memory


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("h100", 989.0, 3.35, 80),
        Accelerator("h200", 989.0, 4.8, 141),
        Accelerator("h20", 148.0, 4.0, 96),
        Accelerator("a100", 312.0, 2.0, 80),
    )
}


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name.lower()]
    except KeyError:
        raise ValueError(f"accelerator {name!r} is not known; known: {sorted(ACCELERATORS)}") from None


def engine_costs(
    params_b: float,
    device: Accelerator,
    *,
    tp: int = 1,
    kv_bytes_per_token: int = 131_072,
    bytes_per_param: float = 2.0,
    bandwidth_efficiency: float = 0.6,
    prefill_mfu: float = 0.35,
    memory_utilization: float = 0.9,
    per_seq_ms: float = 0.06,
) -> dict[str, Any]:
    """The sim engine's step costs (``rollout.sim`` fields) for one replica of ``tp`` devices.

    ``kv_bytes_per_token``: 2 (K and V) x layers x KV heads x head dim x bytes; 131,072 is a
    Llama-3-8B-like model (32 layers, 8 KV heads of 128, bf16), Qwen2.5-7B is 57,344, a 7B model
    without grouped-query attention 524,288."""
    for name, value in (
        ("params_b", params_b),
        ("kv_bytes_per_token", kv_bytes_per_token),
        ("bytes_per_param", bytes_per_param),
        ("bandwidth_efficiency", bandwidth_efficiency),
        ("prefill_mfu", prefill_mfu),
        ("memory_utilization", memory_utilization),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    bandwidth = device.hbm_tbps * 1e12 * bandwidth_efficiency * tp  # bytes/s over the replica
    weights = params_b * 1e9 * bytes_per_param
    free = device.hbm_gib * 2**30 * tp * memory_utilization - weights
    if free < kv_bytes_per_token * 1024:
        raise ValueError(
            f"params_b: {params_b:g}B parameters ({weights / 2**30:.0f} GiB) leave no room for a KV cache on "
            f"tp={tp} x {device.name} ({device.hbm_gib:g} GiB each, {memory_utilization:.0%} used): raise --tp"
        )
    return {
        "step_base_ms": weights / bandwidth * 1e3,
        "step_per_seq_ms": per_seq_ms,
        "prefill_per_token_ms": 2 * params_b * 1e9 / (device.tflops * 1e12 * prefill_mfu * tp) * 1e3,
        "step_per_context_token_ms": kv_bytes_per_token / bandwidth * 1e3,
        "kv_capacity_tokens": int(free // kv_bytes_per_token),
    }


__all__ = ["Accelerator", "ACCELERATORS", "accelerator", "engine_costs"]
