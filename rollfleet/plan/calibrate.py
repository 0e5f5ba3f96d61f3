"""Measure an engine's step costs and fit the sim engine's cost model to them: a named profile.

What a plan predicts is only as good as the four constants of :class:`~rollfleet.engines.sim.cost.
StepCost` (a step's fixed cost, its cost per running sequence and per token of context, the cost
of an uncached prompt token). This module measures them on a real engine through rollfleet's own
engine interface (any registered engine: vLLM, SGLang), so a profile comes from the engine and
hardware it describes instead of a guess.

How: batches of ``B`` identical-length requests (prompt ``P`` tokens, exactly ``T`` output tokens,
``ignore_eos``) are started together and timed to the last answer. Under the cost model such a
batch takes (one prefill of ``B*P`` tokens, then ``T`` steps over ``B`` sequences whose context
grows by one token a step)::

    latency = T*base + T*B*per_seq + B*(T*P + T*(T-1)/2)*per_context + B*P*per_prefill + overhead

which is linear in the five unknowns: a least-squares fit over a grid of ``(B, P, T)`` gives them
(non-negative: a term that would come out negative is dropped and the rest refitted). Each probe
runs ``repeats`` times and the fastest run counts: on a shared machine noise only adds time.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from rollfleet.engines.base import Engine

TERMS = ("step_base_ms", "step_per_seq_ms", "step_per_context_token_ms", "prefill_per_token_ms", "overhead_ms")


@dataclass(frozen=True)
class Probe:
    """A batch of ``batch`` requests, ``prompt_tokens`` in and exactly ``output_tokens`` out."""

    batch: int
    prompt_tokens: int
    output_tokens: int

    def features(self) -> list[float]:
        b, p, t = self.batch, self.prompt_tokens, self.output_tokens
        return [t, t * b, b * (t * p + t * (t - 1) / 2), b * p, 1.0]


@dataclass
class Measurement:
    probe: Probe
    seconds: float  # the fastest of the repeats


@dataclass
class Profile:
    """Fitted constants (ms) and how well they explain the measurements."""

    constants: dict[str, float]
    measurements: list[Measurement] = field(default_factory=list)

    def predict_s(self, probe: Probe) -> float:
        return sum(c * x for c, x in zip((self.constants[k] for k in TERMS), probe.features())) / 1000.0

    def errors(self) -> list[float]:
        """Relative error of the prediction per measurement (predicted / measured - 1)."""
        return [self.predict_s(m.probe) / m.seconds - 1.0 for m in self.measurements]

    def sim_section(self) -> dict[str, float]:
        """The ``rollout.sim`` keys this profile sets. The per-request overhead (the client's and
        the HTTP hop's, not the engine's steps) is reported, not set: measured on an idle machine,
        it is not what a loaded one pays (set ``rollout.sim.request_overhead_ms`` to price one)."""
        # significant digits, not decimals of a millisecond: a GPU's per-context-token cost is
        # 1e-6 ms to 1e-5 ms (rounded to 6 decimals, -20%; under 5e-7, written as 0)
        return {k: float(f"{self.constants[k]:.6g}") for k in TERMS if k != "overhead_ms"}


def default_grid() -> list[Probe]:
    return [Probe(b, p, t) for b, p, t in itertools.product((1, 4, 16, 32), (32, 512), (16, 96))]


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``x @ coef ~ y`` with every coefficient >= 0, by elimination: fit, drop
    the most negative term (it is 0), refit the rest. Cost terms cannot be negative, and a term
    the data cannot support is better left out than fitted below zero."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if coef.min() >= 0 or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    out = np.zeros(x.shape[1])
    out[active] = np.maximum(coef, 0.0)
    return out


def fit(measurements: Sequence[Measurement]) -> Profile:
    """The profile's constants: :func:`nonnegative_lstsq` over the measurements."""
    if len(measurements) < len(TERMS):
        raise ValueError(f"need at least {len(TERMS)} measurements to fit {len(TERMS)} terms, got {len(measurements)}")
    bad = next((m for m in measurements if not (math.isfinite(m.seconds) and m.seconds > 0)), None)
    if bad is not None:
        raise ValueError(f"measurement of {bad.probe}: seconds must be a finite number > 0, got {bad.seconds}")
    x = np.array([m.probe.features() for m in measurements], dtype=float)
    y = np.array([m.seconds * 1000.0 for m in measurements], dtype=float)
    if np.linalg.matrix_rank(x) < len(TERMS):
        # probes that differ too little (all alike, say) fit any mix of the terms equally well:
        # the constants would be arbitrary, and the errors 0
        raise ValueError(
            f"the probes cannot tell the {len(TERMS)} cost terms apart ({', '.join(TERMS)}): vary the batch, "
            "prompt and output lengths (see default_grid)"
        )
    # Relative errors matter (a 10 ms probe and a 3 s probe alike): weight each row by 1/y.
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nonnegative_lstsq(x * w[:, None], y * w)
    return Profile({term: float(c) for term, c in zip(TERMS, coef)}, list(measurements))


def probe_prompt(probe: Probe, index: int, salt: int) -> list[int]:
    """A prompt no other request of the calibration shares a prefix with (its first tokens spell
    ``salt`` and ``index``; prefix caches match from the first block), ids in [10, 400)."""
    head = [10 + salt % 390, 10 + salt // 390 % 390, 10 + index % 390, 10 + index // 390 % 390]
    body = [10 + (index * 17 + j * 7) % 390 for j in range(max(0, probe.prompt_tokens - len(head)))]
    return (head + body)[: probe.prompt_tokens]


async def _run_batch(engine: Engine, probe: Probe, salt: int) -> float:
    """Start ``probe.batch`` requests together; seconds until the last answer."""
    clock = asyncio.get_running_loop().time
    params: dict[str, Any] = {
        "max_tokens": probe.output_tokens,
        "min_tokens": probe.output_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
    }
    started = clock()
    outputs = await asyncio.gather(
        *(
            engine.generate(f"calibrate-{salt}-{i}", probe_prompt(probe, i, salt), dict(params))
            for i in range(probe.batch)
        )
    )
    elapsed = clock() - started
    short = [len(o.token_ids) for o in outputs if len(o.token_ids) != probe.output_tokens]
    if short:
        raise RuntimeError(f"{probe}: the engine returned {short[0]} tokens, not {probe.output_tokens}")
    return elapsed


async def measure(
    engine: Engine,
    grid: Sequence[Probe],
    *,
    repeats: int = 2,
    warmup: bool = True,
    on_probe: Optional[Callable[[Measurement], None]] = None,
) -> list[Measurement]:
    """Time every probe ``repeats`` times on a started ``engine`` (fastest run kept), on the
    running loop's clock (wall time; simulated seconds on a virtual-time loop). ``warmup`` runs
    the whole grid once untimed first: an engine's first batches of a new shape pay one-off
    costs (kernel selection, allocations; on vLLM's CPU build up to 10x the step) that are not
    what a long run pays."""
    if repeats < 1:  # none would leave every probe unmeasured (inf) and fit a free engine
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    salt = 0
    if warmup:
        for probe in grid:
            salt += 1
            await _run_batch(engine, probe, salt)
    out = []
    for probe in grid:
        best = float("inf")
        for _ in range(repeats):
            salt += 1
            best = min(best, await _run_batch(engine, probe, salt))
        m = Measurement(probe, best)
        out.append(m)
        if on_probe is not None:
            on_probe(m)
    return out


__all__ = ["Probe", "Measurement", "Profile", "TERMS", "default_grid", "fit", "measure", "probe_prompt"]
