"""A generation's token budget, as the resuming paths (fully-async, streamed) read it, what a
resumed attempt asks for after some of it is spent, and whether an aborted attempt made progress."""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.errors import InvalidRequest
from rollfleet.types import BUDGET_KEYS, SamplingParams


def token_budget(params: SamplingParams, response_length: Any, room: Optional[int] = None) -> tuple[str, int]:
    """``(key, budget)``: the caller's ``max_tokens`` / ``max_new_tokens``, else the configured
    ``response_length``, at most the ``room`` the context leaves after the prompt (the default a
    replica gives a request without a budget: sent explicitly, ``response_length`` past the room
    was refused, so a late turn of a long trajectory failed on the resuming paths where a plain
    ``generate`` served it). Checked before any arithmetic on it ("16" or True must not become a
    budget)."""
    key = next((k for k in BUDGET_KEYS if params.get(k) is not None), None)
    if key is None:
        if isinstance(response_length, int) and not isinstance(response_length, bool) and response_length > 0:
            return "max_tokens", min(response_length, room) if room is not None and room >= 1 else response_length
        raise ValueError("no token budget: pass max_tokens/max_new_tokens or configure response_length")
    budget = params[key]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise InvalidRequest(f"sampling_params.{key}", "an integer >= 1", budget)
    for other in BUDGET_KEYS:
        # The replica refuses a pair that differs, but every resumed attempt sends both set to what
        # is left: the caller's conflict is refused here, as a plain generate's is there.
        if other != key and params.get(other) is not None and params[other] != budget:
            raise InvalidRequest(
                f"sampling_params.{other}", f"equal to {key} ({budget}) when both are given", params[other]
            )
    return key, budget


def room_after(max_model_len: Optional[int], prompt_ids: Any) -> Optional[int]:
    """The tokens the context leaves after the prompt (None: unknown, or no sized prompt)."""
    try:
        return None if max_model_len is None else max_model_len - len(prompt_ids)
    except TypeError:  # no length: the replica names the field
        return None


#: Lower bounds on the tokens to generate: a resumed attempt owes what is left of them.
MIN_KEYS: tuple[str, ...] = ("min_tokens", "min_new_tokens")


def resumed_params(params: SamplingParams, key: str, budget: int, done: int) -> SamplingParams:
    """The sampling params of an attempt after ``done`` of ``budget`` tokens: every budget key says
    what is left (the replica refuses ``max_tokens`` and ``max_new_tokens`` that differ), every
    minimum what is left of it (unlowered, it would outlast the budget and be refused, or hold
    back the end of the sequence longer than the caller asked)."""
    attempt = dict(params)
    for budget_key in {key, *(k for k in BUDGET_KEYS if params.get(k) is not None)}:
        attempt[budget_key] = budget - done
    for min_key in MIN_KEYS:
        floor = params.get(min_key)
        if isinstance(floor, int) and not isinstance(floor, bool):
            attempt[min_key] = max(0, floor - done)
    return attempt


class StallCount:
    """The resume rule both resuming paths (fully-async, streamed) apply after an aborted attempt.
    It made progress if it brought tokens, or the weights are new since the attempt before, or the
    fleet has moved past the weights it ran on (the abort was a weight update's), once per move: a
    replica left behind on old weights that aborts every attempt at once must not count as
    progress each time (the generation resent at once, forever). Only aborts without progress,
    ``max_attempts`` in a row, end a generation (``exhausted``): it runs to its budget however
    often the trainer syncs."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.stalled = 0
        self.exhausted = False
        self._version: Any = None
        self._moved: Optional[tuple[Any, Optional[int]]] = None  # the last (attempt's, fleet's) versions counted

    def after_abort(self, new_tokens: bool, resumed: bool, version: Any, fleet_version: Optional[int]) -> int:
        """Count one aborted attempt (``resumed``: not the first); the backoffs to wait before the
        next (0: at once)."""
        moved = version is not None and fleet_version is not None and fleet_version > version
        if moved and self._moved == (version, fleet_version):
            moved = False  # counted already: the abort is the stale replica's, not an update's
        elif moved:
            self._moved = (version, fleet_version)
        progressed = new_tokens or (resumed and version != self._version) or moved
        self._version = version
        self.stalled = 0 if progressed else self.stalled + 1
        self.exhausted = self.stalled >= self.max_attempts
        return self.stalled


__all__ = ["MIN_KEYS", "StallCount", "resumed_params", "room_after", "token_budget"]
