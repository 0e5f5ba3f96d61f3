"""Unique ids without a system call each: a random prefix per process and a counter.

Why: every request takes an id (the agent loop's session key, the replica's engine id), and
``uuid.uuid4()`` reads the OS's random source each time: 3% of a plan's wall time, where a plan
makes hundreds of thousands of requests. An id here is as wide as ``uuid4().hex`` (32 hex digits):
80 random bits drawn once per process (again in a forked child) and a 48-bit counter, so ids of
different processes differ as uuid4's do and ids of one process do not repeat before 2**48 of
them.
"""

from __future__ import annotations

import itertools
import os
import secrets

_prefix = ""
_counter: "itertools.count[int]" = itertools.count()


def _reset() -> None:
    global _prefix, _counter
    _prefix = secrets.token_hex(10)
    _counter = itertools.count()


_reset()
os.register_at_fork(after_in_child=_reset)


def unique_hex() -> str:
    """A fresh id of 32 hex digits, unique across processes (see the module docstring)."""
    return f"{_prefix}{next(_counter) & 0xFFFF_FFFF_FFFF:012x}"


__all__ = ["unique_hex"]
