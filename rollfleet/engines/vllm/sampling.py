"""The fleet's sampling keys in vLLM's names.

The replica accepts the keys callers know from either engine (:data:`~rollfleet.server.validation.SAMPLING_KEYS`:
verl and SGLang users write ``max_new_tokens``, ``sampling_seed``, ``json_schema``); each engine
maps them to its own. vLLM's ``SamplingParams`` ignores a key it does not know, so an SGLang name
sent as it is was silently dropped: a ``sampling_seed`` gave unseeded samples, a ``json_schema``
unconstrained ones that were then trained as if constrained. Here each is renamed, and a key vLLM
has no counterpart for is refused naming it.
"""

from __future__ import annotations

from typing import Any

from rollfleet.errors import InvalidRequest
from rollfleet.types import SamplingParams

#: SGLang's name -> vLLM's.
RENAMED = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}
#: Constraint keys -> the key of vLLM's ``structured_outputs`` (its ``SamplingParams`` has no
#: ``structural_tag`` of its own: sent as it was, the samples came back unconstrained).
CONSTRAINTS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}
#: SGLang keys with no vLLM counterpart.
UNSUPPORTED = frozenset({"stop_regex", "no_stop_trim", "custom_params"})


def vllm_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """``params`` with SGLang's names as vLLM's (a new dict; ``None`` values dropped)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if key in UNSUPPORTED:
            raise InvalidRequest(f"sampling_params.{key}", "a key vLLM has (this one is SGLang's alone)", value)
        if key in CONSTRAINTS:
            _set(out, "structured_outputs", {CONSTRAINTS[key]: value}, key)
        else:
            _set(out, RENAMED.get(key, key), value, key)
    return out


def _set(out: dict[str, Any], name: str, value: Any, given_as: str) -> None:
    if name in out and out[name] != value:  # seed and sampling_seed, or two constraints
        raise InvalidRequest(f"sampling_params.{given_as}", f"the same as the '{name}' also given", value)
    out[name] = value


__all__ = ["vllm_sampling_params", "RENAMED", "CONSTRAINTS", "UNSUPPORTED"]
