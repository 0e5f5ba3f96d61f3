"""Per-token lists converted to plain Python numbers, at C speed in the usual case.

An agent loop copies every response's token ids, logprobs and weight versions into its output;
written as ``[int(t) for t in ids]`` that is one interpreted step per token, a few percent of a
large plan's wall time. The values are almost always plain ints and floats already, and checking
that (``set(map(type, values))``) runs in C; only lists that need converting are converted.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


def ints(values: Iterable[Any]) -> list[int]:
    """``[int(v) for v in values]`` (a new list)."""
    out = list(values)
    return out if set(map(type, out)) <= {int} else [int(v) for v in out]


def floats(values: Iterable[Any]) -> list[float]:
    """``[float(v) for v in values]`` (a new list)."""
    out = list(values)
    return out if set(map(type, out)) <= {float} else [float(v) for v in out]


def versions(values: Iterable[Optional[Any]], unknown: int) -> list[int]:
    """``[unknown if v is None else int(v) for v in values]`` (a new list)."""
    out = list(values)
    if out and type(out[0]) is int and out.count(out[0]) == len(out):
        # Every value equals one int (the usual case: one version per attempt). ``count`` is a
        # pass in C that compares by identity first, several times cheaper than the type check
        # below, and ``int(v)`` of a value equal to that int is that int: the same list.
        return [out[0]] * len(out)
    if set(map(type, out)) <= {int}:
        return out  # type: ignore[return-value]  # checked: ints only
    return [unknown if v is None else int(v) for v in out]


__all__ = ["floats", "ints", "versions"]
