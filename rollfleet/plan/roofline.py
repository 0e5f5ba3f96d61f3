"""Engine step costs from the model size, the accelerator and tensor parallelism: a roofline.

For a plan of a model or an accelerator nobody has calibrated (``rollfleet calibrate`` measures a
real engine; this estimates one). A decode step streams every weight from memory once (the step's
fixed cost) and reads every running sequence's KV cache (its cost per token of context); a
prefill computes 2 FLOPs per parameter per prompt token; the KV cache gets the memory the weights
leave. Tensor parallelism splits the weights, the KV cache and the FLOPs over ``tp`` devices.
Efficiencies are what a serving engine reaches, not peaks: with the defaults, a 7B model in bf16
on one H100 comes out at the published numbers the sim engine's defaults were taken from
(``profiles/h100-7b.yaml``: ~7 ms a step, ~25k prefill tokens/s).

Tensor parallelism also costs time: every layer all-reduces its activations twice (after
attention, after the MLP), ``tokens x hidden x 2`` bytes each, for every token of the step. A
step's all-reduces cost a latency each (the step's fixed cost) plus a ring all-reduce's traffic,
``2 (tp - 1) / tp`` times the message, over the accelerator's NVLink (each token's cost). A decode
step's messages are small (a few KB to about 1 MiB): such an all-reduce is latency-bound and
reaches a small share of NVLink's peak; the two constants are fitted to vLLM's custom all-reduce
on H100 at tp 2, 4 and 8 (published in SGLang's pull request 2904), which they give within 30%
from 512 bytes to 1 MiB (beyond that, in decode batches over ``1 MiB / (2 x hidden)`` tokens, they
probably overprice it: larger all-reduces reach more of the link; not checked). A prefill
chunk's messages are megabytes, priced at 70% of NVLink's peak (assumed: what NCCL's large
all-reduces reach, not measured here). Without ``layers`` and ``hidden`` the shape is estimated
from the size.

Not modelled: attention FLOPs in prefill (quadratic in the prompt), CUDA graphs (which shave some
of the all-reduce latency), and the per-sequence cost (sampling, scheduling), which is a constant
(``per_seq_ms``) rather than derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Accelerator:
    name: str
    tflops: float  # dense bf16 peak
    hbm_tbps: float  # memory bandwidth
    hbm_gib: float  # memory
    link_gbps: float  # NVLink, each direction, per device (GB/s)


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("h100", 989.0, 3.35, 80, 450.0),
        Accelerator("h200", 989.0, 4.8, 141, 450.0),
        Accelerator("h20", 148.0, 4.0, 96, 450.0),
        Accelerator("a100", 312.0, 2.0, 80, 300.0),
    )
}


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name.lower()]
    except KeyError:
        raise ValueError(f"accelerator {name!r} is not known; known: {sorted(ACCELERATORS)}") from None


ALLREDUCE_LATENCY_US = 9.0  # a small all-reduce, launch to done (vLLM's custom all-reduce, H100)
ALLREDUCE_LINK_EFFICIENCY = 0.12  # share of NVLink's peak a ring all-reduce of <= 1 MiB reaches
ALLREDUCE_LARGE_LINK_EFFICIENCY = 0.7  # ... and one of many megabytes (a prefill chunk's), assumed


def allreduce_us(
    nbytes: float,
    tp: int,
    device: Accelerator,
    *,
    latency_us: float = ALLREDUCE_LATENCY_US,
    link_efficiency: float = ALLREDUCE_LINK_EFFICIENCY,
) -> float:
    """Microseconds for one all-reduce of ``nbytes`` over ``tp`` devices (0 for one device)."""
    if tp == 1:
        return 0.0
    return latency_us + 2 * (tp - 1) / tp * nbytes / (device.link_gbps * 1e9 * link_efficiency) * 1e6


def model_shape(params_b: float) -> tuple[int, int]:
    """(layers, hidden) of a dense transformer of ``params_b`` billion parameters, when nobody gave
    them: ``12 x layers x hidden^2`` parameters at ``hidden = 128 x layers`` (Llama-2-7B: 32 x 4,096;
    Llama-70B: 80 x 8,192, where this gives 71 x 9,088: layers x hidden, what the all-reduces cost
    by, within 2%)."""
    layers = max(1, round((params_b * 1e9 / (12 * 128**2)) ** (1 / 3)))
    return layers, 128 * layers


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
    layers: int | None = None,
    hidden: int | None = None,
    activation_bytes: float = 2.0,
    allreduce_latency_us: float = ALLREDUCE_LATENCY_US,
    allreduce_link_efficiency: float = ALLREDUCE_LINK_EFFICIENCY,
    allreduce_large_link_efficiency: float = ALLREDUCE_LARGE_LINK_EFFICIENCY,
) -> dict[str, Any]:
    """The sim engine's step costs (``rollout.sim`` fields) for one replica of ``tp`` devices.

    ``kv_bytes_per_token``: 2 (K and V) x layers x KV heads x head dim x bytes; 131,072 is a
    Llama-3-8B-like model (32 layers, 8 KV heads of 128, bf16), Qwen2.5-7B is 57,344, a 7B model
    without grouped-query attention 524,288. ``layers`` and ``hidden`` price tensor parallelism's
    all-reduces (estimated from ``params_b`` when not given; unused at ``tp=1``)."""
    for name, value in (
        ("params_b", params_b),
        ("kv_bytes_per_token", kv_bytes_per_token),
        ("bytes_per_param", bytes_per_param),
        ("bandwidth_efficiency", bandwidth_efficiency),
        ("prefill_mfu", prefill_mfu),
        ("memory_utilization", memory_utilization),
        ("activation_bytes", activation_bytes),
        ("allreduce_link_efficiency", allreduce_link_efficiency),
        ("allreduce_large_link_efficiency", allreduce_large_link_efficiency),
    ):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if allreduce_latency_us < 0:
        raise ValueError(f"allreduce_latency_us must be >= 0, got {allreduce_latency_us}")
    for name, dim in (("layers", layers), ("hidden", hidden)):
        if dim is not None and dim < 1:
            raise ValueError(f"{name} must be >= 1, got {dim}")
    if layers is None or hidden is None:
        est_layers, est_hidden = model_shape(params_b)
        layers, hidden = layers or est_layers, hidden or est_hidden
    bandwidth = device.hbm_tbps * 1e12 * bandwidth_efficiency * tp  # bytes/s over the replica
    weights = params_b * 1e9 * bytes_per_param
    free = device.hbm_gib * 2**30 * tp * memory_utilization - weights
    if free < kv_bytes_per_token * 1024 and free > 0:
        raise ValueError(
            f"kv_bytes_per_token: {kv_bytes_per_token:g} bytes a token leave no room for a KV cache of 1,024 tokens in "
            f"the {free / 2**30:.1f} GiB that {params_b:g}B parameters leave on tp={tp} x {device.name}: raise --tp"
        )
    if free < kv_bytes_per_token * 1024:
        raise ValueError(
            f"params_b: {params_b:g}B parameters ({weights / 2**30:.0f} GiB) leave no room for a KV cache on "
            f"tp={tp} x {device.name} ({device.hbm_gib:g} GiB each, {memory_utilization:.0%} used): raise --tp"
        )
    # Two all-reduces a layer: their latency once a step, their traffic per token of the step
    # (a decoding sequence's one token or a prompt token being prefilled).
    allreduces = 2 * layers
    token_bytes = hidden * activation_bytes

    def traffic_ms(efficiency: float) -> float:  # one token's share of a step's all-reduces
        return allreduces * allreduce_us(token_bytes, tp, device, latency_us=0.0, link_efficiency=efficiency) * 1e-3

    latency_ms = allreduces * allreduce_us(0, tp, device, latency_us=allreduce_latency_us) * 1e-3
    prefill_ms = 2 * params_b * 1e9 / (device.tflops * 1e12 * prefill_mfu * tp) * 1e3
    return {
        "step_base_ms": weights / bandwidth * 1e3 + latency_ms,
        "step_per_seq_ms": per_seq_ms + traffic_ms(allreduce_link_efficiency),
        "prefill_per_token_ms": prefill_ms + traffic_ms(allreduce_large_link_efficiency),
        "step_per_context_token_ms": kv_bytes_per_token / bandwidth * 1e3,
        "kv_capacity_tokens": int(free // kv_bytes_per_token),
    }


__all__ = [
    "ALLREDUCE_LARGE_LINK_EFFICIENCY",
    "ALLREDUCE_LATENCY_US",
    "ALLREDUCE_LINK_EFFICIENCY",
    "Accelerator",
    "ACCELERATORS",
    "accelerator",
    "allreduce_us",
    "engine_costs",
    "model_shape",
]
