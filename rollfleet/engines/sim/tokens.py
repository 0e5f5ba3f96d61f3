"""What the sim engine samples: token ids and logprobs as a function of the weights, the request
and the position (no model, no randomness at run time).

Two implementations of one rule, kept side by side: :func:`next_token` makes one token (the
step-at-a-time loop, where a numpy call per token would cost more than the token), :func:`tokens`
makes many at once, vectorised (a fast-forward produces a request's counted tokens in one go).
They must agree bit for bit; ``tests/engines/test_sim_fast_forward.py`` compares them. The
weights enter as a number, :func:`_fingerprint`.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rollfleet.engines.sim.batch import _Request

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MULT = 0xBF58476D1CE4E5B9
# the same constants as numpy scalars, for the vectorised rounds
_MULT_U64 = np.uint64(_MULT)
_SHIFT_U64 = np.uint64(31)
_SEVEN_U64 = np.uint64(7)
_LOGPROB_BINS_U64 = np.uint64(10_000)


def _mix(*values: int) -> int:
    """A fast, process-independent 64-bit mix of integers (splitmix64 steps)."""
    h = _GOLDEN
    for v in values:
        h = (h ^ (v & _MASK64)) * _MULT & _MASK64
        h ^= h >> 31
    return h


def _fingerprint(weights: Any) -> int:
    """A stable number for a weights object: what changes it changes the simulated tokens."""
    if weights is None:
        return 0
    if isinstance(weights, int):
        return weights
    if isinstance(weights, (str, bytes)):
        data = weights.encode() if isinstance(weights, str) else weights
        return zlib.crc32(data)
    if isinstance(weights, dict):
        h = 0
        for key in sorted(weights, key=str):
            value = weights[key]
            summary = repr(getattr(value, "shape", None))
            try:  # torch tensors and numpy arrays: use a checksum of a few values
                flat = value.reshape(-1)[:16]
                summary += repr([float(x) for x in flat])
            except Exception:
                summary += repr(value)[:200]
            h = _mix(h, zlib.crc32(f"{key}:{summary}".encode()))
        return h
    return zlib.crc32(repr(weights).encode())


def _mix_round(state: Any, values: Any) -> Any:
    """One more value into :func:`_mix`'s state, elementwise over numpy uint64 arrays:
    ``_mix(*prefix, v) == _mix_round(_mix(*prefix), v)`` (the products wrap modulo 2**64)."""
    x = state ^ values
    x *= _MULT_U64
    x ^= x >> _SHIFT_U64
    return x


def next_token(req: "_Request", vocab_size: int, eos: int) -> tuple[int, float]:
    """The token at ``req``'s next position and its logprob. A natural response ends with ``eos``
    at its drawn length; before that an id to stop on becomes the next id (twice at most)."""
    pos = len(req.generated)
    if req.scripted is not None:
        tok = req.scripted[pos]
    else:
        tok = _mix(req.token_seed, pos) % vocab_size
        if pos + 1 >= req.target_len and not req.ignore_eos:
            tok = eos
        elif tok == eos or tok in req.stop_ids:
            tok = (tok + 1) % vocab_size
            if tok == eos or tok in req.stop_ids:
                tok = (tok + 1) % vocab_size
    logprob = -((_mix(req.token_seed, pos, 7) % 10_000) / 2_000.0)  # in (-5, 0]
    return tok, logprob


def tokens(req: "_Request", start: int, count: int, vocab_size: int, eos: int) -> tuple[list[int], list[float]]:
    """``count`` tokens of ``req`` from position ``start``: what :func:`next_token` gives for each,
    computed for all of them at once."""
    pos = np.arange(start, start + count, dtype=np.uint64)
    h = _mix_round(np.uint64(_mix(req.token_seed)), pos)
    bins = _mix_round(h, _SEVEN_U64)
    bins %= _LOGPROB_BINS_U64
    logprobs = bins / -2_000.0  # -(bins / 2000): IEEE division rounds the same for either sign
    if req.scripted is not None:
        return req.scripted[start : start + count], logprobs.tolist()
    ids = (h % np.uint64(vocab_size)).astype(np.int64)

    def avoided(values: Any) -> Any:  # np.isin, cheaper for the few stop ids a request has
        hit = values == eos
        for stop in req.stop_ids:
            hit |= values == stop
        return hit

    hit = avoided(ids)
    if hit.any():
        ids[hit] = (ids[hit] + 1) % vocab_size
        again = hit & avoided(ids)
        ids[again] = (ids[again] + 1) % vocab_size
    if not req.ignore_eos:
        ids[max(0, req.target_len - 1 - start) :] = eos  # every position p with p + 1 >= target_len
    return ids.tolist(), logprobs.tolist()


__all__ = ["next_token", "tokens", "_mix", "_fingerprint"]
