"""OpenAI request fields -> the fleet's ``sampling_params``, and fleet field names -> request fields.

Two translations, kept apart from the routes so each route states only what differs (which field
holds the prompt, which holds the budget):

* the request's sampling options become the plain dict every engine takes; absent options stay
  absent (the engine's defaults apply), stop strings become stop token ids;
* an ``InvalidRequest`` from a replica names *fleet* fields (``prompt_ids[3]``,
  ``sampling_params.max_tokens``); :func:`field_mapper` renames them to what the caller sent
  (``prompt``, ``max_completion_tokens``) so the 400's ``param`` points at the caller's field.

The token budget is settled here, not at the replica: the gateway knows the context length, so a
prompt that leaves no room fails with the prompt named, and an absent ``max_tokens`` becomes
``min(rollout.response_length, room left)`` (the fully-async client needs an explicit budget to
resume within it).
"""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.gateway.codec import TextCodec
from rollfleet.gateway.errors import FieldMap, bad_request
from rollfleet.gateway.protocol import _GenerationRequest
from rollfleet.types import SamplingParams

#: Request fields copied to ``sampling_params`` as they are, when given.
_PASS_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def token_budget(
    requested: Optional[int],
    prompt_len: int,
    *,
    max_model_len: int,
    default: int,
    prompt_param: str,
    budget_param: str,
) -> int:
    """The ``max_tokens`` to send, or a 400 naming the prompt or the budget field."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            prompt_param,
            f"the prompt is {prompt_len} tokens; this model's context is {max_model_len} tokens, "
            "which leaves no room for a response",
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default, room)
    if requested > room:
        raise bad_request(
            budget_param,
            f"{budget_param}={requested} plus the {prompt_len}-token prompt exceeds this model's context of "
            f"{max_model_len} tokens (at most {room} here)",
            code="context_length_exceeded",
        )
    return requested


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of ``n``: with a ``seed``, its own, ``seed + index``, as
    vLLM seeds the children of an ``n`` request. The same seed for all would make every choice
    the same sample (a GRPO group of one answer, every advantage zero)."""
    seed = params.get("seed")
    if seed is None or index == 0:
        return params
    seed += index
    return {**params, "seed": seed - 2**64 if seed >= 2**64 else seed}  # wrapped into torch's range


def sampling_params(
    req: _GenerationRequest, max_tokens: int, codec: Optional[TextCodec], vocab_size: Optional[int] = None
) -> SamplingParams:
    """The fleet's sampling parameters for one request (validated again by the replica).
    ``codec`` None: no stop strings (the token route); ``vocab_size`` then bounds ``logit_bias``."""
    params: SamplingParams = {"max_tokens": max_tokens}
    for key in _PASS_THROUGH:
        value = getattr(req, key)
        if value is not None:
            params[key] = value
    if req.ignore_eos:
        params["ignore_eos"] = True
    stop_ids = list(req.stop_token_ids or ())
    if req.stop:
        if codec is None:
            raise bad_request("stop", "stop strings need a tokenizer; pass stop_token_ids", code="unsupported_value")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        stop_ids += codec.stop_token_ids(stops, indexed=not isinstance(req.stop, str))
    if stop_ids:
        params["stop_token_ids"] = stop_ids
    constraint = structured_outputs(req)
    if constraint is not None:
        params["structured_outputs"] = constraint
    if req.logit_bias:
        params["logit_bias"] = logit_bias(req.logit_bias, codec.vocab_size if codec is not None else vocab_size)
    return params


def logit_bias(given: dict[str, Any], vocab_size: Optional[int]) -> dict[str, float]:
    """OpenAI's ``logit_bias`` checked: each key a token id of the vocabulary, each bias in
    [-100, 100]. Passed on as given (token ids as strings: JSON's keys, what vLLM reads)."""
    out: dict[str, float] = {}
    for key, bias in given.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias.{key}", "a token id (an integer, as a string)") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad_request(f"logit_bias.{key}", f"a token id in [0, {vocab_size})")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias.{key}", f"a bias in [-100, 100], got {bias}")
        out[str(token)] = float(bias)
    return out


#: The constraints of vLLM's ``structured_outputs`` (exactly one), and the options beside them.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_CONSTRAINT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def structured_outputs(req: _GenerationRequest) -> Optional[dict[str, Any]]:
    """The request's output constraint as vLLM's ``structured_outputs`` (None: unconstrained);
    OpenAI's ``response_format`` becomes one too."""
    given, fmt = req.structured_outputs, req.response_format
    if given is not None:
        if fmt is not None and fmt.type != "text":
            raise bad_request("response_format", "give response_format or structured_outputs, not both")
        for key in given:
            if key not in _CONSTRAINTS and key not in _CONSTRAINT_OPTIONS:
                raise bad_request(
                    f"structured_outputs.{key}", f"one of {', '.join(_CONSTRAINTS + _CONSTRAINT_OPTIONS)}"
                )
        chosen = [key for key in _CONSTRAINTS if given.get(key) is not None]
        if len(chosen) != 1:
            raise bad_request(
                "structured_outputs", f"exactly one of {', '.join(_CONSTRAINTS)} (given: {', '.join(chosen) or 'none'})"
            )
        return dict(given)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema", "a JSON schema object, required with type json_schema")
    return {"json": schema}


def field_mapper(prompt_param: str, budget_param: str = "max_tokens", keep_prompt_index: bool = False) -> FieldMap:
    """Rename a fleet field (from ``InvalidRequest.field``) to the caller's request field."""

    def mapped(field: str) -> str:
        if field.startswith("prompt_ids"):
            return prompt_param + (field[len("prompt_ids") :] if keep_prompt_index else "")
        if field.startswith("sampling_params."):
            name = field[len("sampling_params.") :]
            return budget_param if name in ("max_tokens", "max_new_tokens") else name
        return field

    return mapped


__all__ = ["token_budget", "sampling_params", "structured_outputs", "logit_bias", "field_mapper"]
