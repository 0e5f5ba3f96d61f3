"""A generation's token budget, as the resuming paths (fully-async, streamed) read it."""

from __future__ import annotations

from typing import Any

from rollfleet.errors import InvalidRequest
from rollfleet.types import BUDGET_KEYS, SamplingParams


def token_budget(params: SamplingParams, response_length: Any) -> tuple[str, int]:
    """``(key, budget)``: the caller's ``max_tokens`` / ``max_new_tokens``, else the configured
    ``response_length``. Checked before any arithmetic on it ("16" or True must not become a budget)."""
    key = next((k for k in BUDGET_KEYS if params.get(k) is not None), None)
    if key is None:
        if isinstance(response_length, int) and not isinstance(response_length, bool) and response_length > 0:
            return "max_tokens", response_length
        raise ValueError("no token budget: pass max_tokens/max_new_tokens or configure response_length")
    budget = params[key]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise InvalidRequest(f"sampling_params.{key}", "an integer >= 1", budget)
    return key, budget


__all__ = ["token_budget"]
