"""Input validation at the replica, before a request reaches the engine.

A bad request must fail alone, with an error naming the field and the limit, and never take the
engine down (vLLM's CPU build, for one, dies on some out-of-range inputs). The check is cheap: one
pass over the prompt ids and a handful of comparisons.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Optional

from rollfleet.errors import InvalidRequest
from rollfleet.types import SamplingParams

#: Sampling keys the fleet knows, by the names callers use with vLLM or SGLang (each engine maps
#: them to its own and drops what it has no use for). Anything else is a typo until proven
#: otherwise: an engine-specific key goes under :data:`PASSTHROUGH_KEY`, sent as it is.
SAMPLING_KEYS: frozenset[str] = frozenset(
    {"max_tokens", "max_new_tokens", "min_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
     "seed", "sampling_seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "stop",
     "stop_token_ids", "stop_regex", "ignore_eos", "logprobs", "prompt_logprobs", "detokenize",
     "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "no_stop_trim",
     "bad_words", "logit_bias", "allowed_token_ids", "json_schema", "regex", "ebnf", "structural_tag",
     "structured_outputs", "truncate_prompt_tokens", "extra_args", "custom_params", "priority", "cache_salt"}
)  # fmt: skip
#: A dict of engine-specific sampling keys, merged into the request unchecked.
PASSTHROUGH_KEY = "passthrough"


def _check_keys(params: SamplingParams) -> SamplingParams:
    """``params`` with the passthrough dict merged in; an unknown key is an ``InvalidRequest``
    naming it (with the known key it most resembles), never silently dropped."""
    unknown = [k for k in params if k not in SAMPLING_KEYS and k != PASSTHROUGH_KEY]
    if unknown:
        key = unknown[0]
        hint = _did_you_mean(key, SAMPLING_KEYS)
        raise InvalidRequest(
            f"sampling_params.{key}",
            f"a known sampling key ({hint + ' ' if hint else ''}engine-specific keys go under "
            f"sampling_params.{PASSTHROUGH_KEY})",
            params[key],
        )
    extra = params.pop(PASSTHROUGH_KEY, None)
    if extra is None:
        return params
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise InvalidRequest(f"sampling_params.{PASSTHROUGH_KEY}", "a dict of engine-specific keys", extra)
    refuse_unencodable(extra, f"sampling_params.{PASSTHROUGH_KEY}")  # merged, nothing checks their values
    clash = sorted(k for k in extra if k in params)
    if clash:
        raise InvalidRequest(
            f"sampling_params.{PASSTHROUGH_KEY}.{clash[0]}", "a key not also given at the top level", extra[clash[0]]
        )
    return {**params, **extra}


def _did_you_mean(key: Any, known: frozenset[str]) -> str:
    """``did you mean 'x'?`` for the known name closest to ``key``, or "" when none is close."""
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    return f"did you mean {close[0]!r}?" if close else ""


def validate_profile_options(options: dict[str, Any], accepted: Optional[frozenset[str]], engine: str) -> None:
    """An option ``start_profile`` does not take is an ``InvalidRequest`` naming it, not a trace
    written with settings the caller never got (vLLM's server ignores unknown keys). ``accepted``
    None: the engine's server checks its options itself."""
    if accepted is None:
        return
    unknown = sorted(k for k in options if k not in accepted)
    if unknown:
        key = unknown[0]
        hint = _did_you_mean(key, accepted)
        limit = f"one of {sorted(accepted)}, the {engine} engine's profile options" + (f"; {hint}" if hint else "")
        raise InvalidRequest(key, limit, options[key])


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: The integers JSON carries between the fleet's processes and to the engines (orjson's limit;
#: vLLM's own API bounds ``seed`` alike).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def refuse_unencodable(value: Any, path: str) -> None:
    """Refuse what JSON cannot carry as it is, anywhere in a parameter (nested mappings and lists
    too), naming its path: a NaN or an infinity (orjson writes null, read as "not given", and an
    engine given one through Ray would use it) and an integer past 64 bits (orjson refuses it: a
    bare ``TypeError`` in an engine's encoder, or one request failing a data-plane connection)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(path, "a finite number", value)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT64_MIN <= value <= INT64_MAX:
            raise InvalidRequest(path, "an integer within 64 bits (-2**63 to 2**63 - 1)", value)
    elif isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            refuse_unencodable(item, f"{path}.{key}")


def refuse_unencodable_params(params: Any) -> None:
    """:func:`refuse_unencodable` of every sampling parameter; ``params`` must be a dict (or None)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise InvalidRequest("sampling_params", "a dict", params)
    for key, value in params.items():
        refuse_unencodable(value, f"sampling_params.{key}")


def _logit_bias(given: Any, vocab_size: int) -> dict[str, float]:
    """Token ids of the vocabulary (integers, or strings of them: JSON's keys) to biases in
    [-100, 100], keyed by strings, as the engines' JSON reads them (an integer key, what vLLM's own
    ``SamplingParams`` takes, failed the HTTP engines' encoder with a bare TypeError)."""
    if not isinstance(given, dict):
        raise InvalidRequest("sampling_params.logit_bias", "a mapping of token id to bias", given)
    out: dict[str, float] = {}
    for key, bias in given.items():
        field = f"sampling_params.logit_bias.{key}"
        try:
            token = int(key) if isinstance(key, str) or _is_int(key) else None
        except ValueError:
            token = None
        if token is None:
            raise InvalidRequest(field, "a token id (an integer, or one as a string)", key)
        if not 0 <= token < vocab_size:
            raise InvalidRequest(field, f"a token id in [0, {vocab_size})", key)
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(field, "a bias in [-100, 100]", bias)
        out[str(token)] = float(bias)
    return out


def _is_number(value: Any) -> bool:
    """A finite real number (``1e999`` parses as infinity: not a temperature)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def validate_prompt(prompt_ids: Any, vocab_size: int, max_model_len: int) -> list[int]:
    """Return the prompt as a list of ints, or raise ``InvalidRequest`` naming the bad element."""
    if prompt_ids is None or isinstance(prompt_ids, (str, bytes)):
        raise InvalidRequest("prompt_ids", "a list of token ids", prompt_ids)
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise InvalidRequest("prompt_ids", "a list of token ids", prompt_ids) from None
    if not ids:
        raise InvalidRequest("prompt_ids", "at least 1 token", ids)
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            "prompt_ids", f"length < max_model_len ({max_model_len}), leaving room for 1 new token", len(ids)
        )
    # The common case in C: every id a plain int in range (the loop below, ~10x slower, is for
    # naming the bad element, and for int-like types such as numpy's).
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    out = []
    for i, tok in enumerate(ids):
        if not _is_int(tok):
            raise InvalidRequest(f"prompt_ids[{i}]", "an integer token id", tok)
        tok = int(tok)
        if tok < 0 or tok >= vocab_size:
            raise InvalidRequest(f"prompt_ids[{i}]", f"0 <= id < vocab_size ({vocab_size})", tok)
        out.append(tok)
    return out


def _check_range(
    params: SamplingParams, key: str, lo: Optional[float], hi: Optional[float], *, lo_open=False, integer=False
) -> None:
    if key not in params or params[key] is None:
        return
    value = params[key]
    if integer and not _is_int(value):
        raise InvalidRequest(f"sampling_params.{key}", "an integer", value)
    if not integer and not _is_number(value):
        raise InvalidRequest(f"sampling_params.{key}", "a finite number", value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidRequest(f"sampling_params.{key}", f"{key} {'>' if lo_open else '>='} {lo}", value)
    if hi is not None and value > hi:
        raise InvalidRequest(f"sampling_params.{key}", f"{key} <= {hi}", value)


def validate_sampling_params(
    sampling_params: Optional[SamplingParams],
    *,
    prompt_len: int,
    vocab_size: int,
    max_model_len: int,
    default_max_tokens: Optional[int],
) -> SamplingParams:
    """Return a normalised copy (``max_tokens`` always set, ``max_new_tokens`` folded in).

    The caller's dict is never modified. Unknown keys are refused (see :data:`SAMPLING_KEYS`);
    engine-specific ones travel under ``sampling_params.passthrough``.
    """
    if sampling_params is None:
        sampling_params = {}
    if not isinstance(sampling_params, dict):
        raise InvalidRequest("sampling_params", "a dict", sampling_params)
    # A key given as None is one not given (as JSON's null at the gateway): engines read values.
    params = {k: v for k, v in _check_keys(dict(sampling_params)).items() if v is not None}
    room = max_model_len - prompt_len
    given = {k: params.pop(k) for k in ("max_tokens", "max_new_tokens") if params.get(k) is not None}
    for key, value in given.items():
        if not _is_int(value):
            raise InvalidRequest(f"sampling_params.{key}", "an integer", value)
        if value < 1:
            raise InvalidRequest(f"sampling_params.{key}", f"{key} >= 1", value)
    if len(given) == 2 and given["max_tokens"] != given["max_new_tokens"]:
        raise InvalidRequest(
            "sampling_params.max_new_tokens", "equal to max_tokens when both are given", given["max_new_tokens"]
        )
    if given:
        key, max_tokens = next(iter(given.items()))
        if prompt_len + max_tokens > max_model_len:
            raise InvalidRequest(
                f"sampling_params.{key}",
                f"len(prompt_ids) + {key} <= max_model_len ({max_model_len}); here {prompt_len} + {max_tokens}",
                max_tokens,
            )
    else:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    params["max_tokens"] = int(max_tokens)

    _check_range(params, "temperature", 0.0, None)
    _check_range(params, "top_p", 0.0, 1.0, lo_open=True)
    _check_range(params, "min_p", 0.0, 1.0)
    _check_range(params, "repetition_penalty", 0.0, None, lo_open=True)
    _check_range(params, "presence_penalty", -2.0, 2.0)
    _check_range(params, "frequency_penalty", -2.0, 2.0)
    for key in ("min_tokens", "min_new_tokens"):  # the sim engine reads either, vLLM the first
        _check_range(params, key, 0, params["max_tokens"], integer=True)
    if params.get("min_tokens") is not None and params.get("min_new_tokens") not in (None, params["min_tokens"]):
        raise InvalidRequest(
            "sampling_params.min_new_tokens", "equal to min_tokens when both are given", params["min_new_tokens"]
        )
    for key in ("seed", "sampling_seed"):  # sampling_seed: the sim engine's name, vLLM's seed
        _check_range(params, key, None, None, integer=True)
    if params.get("top_k") is not None:
        top_k = params["top_k"]
        if not _is_int(top_k) or (top_k < 1 and top_k not in (0, -1)):
            raise InvalidRequest("sampling_params.top_k", "-1 or 0 (disabled) or an integer >= 1", top_k)
    n = params.pop("n", 1)
    if n != 1:
        raise InvalidRequest("sampling_params.n", "n == 1 (issue one request per sample; groups share a prompt)", n)
    logprobs = params.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool) and not (_is_int(logprobs) and logprobs >= 0):
        raise InvalidRequest("sampling_params.logprobs", "a bool or an integer >= 0", logprobs)
    stops = params.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, (list, tuple)):
            raise InvalidRequest("sampling_params.stop_token_ids", "a list of token ids", stops)
        for i, tok in enumerate(stops):
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise InvalidRequest(
                    f"sampling_params.stop_token_ids[{i}]", f"0 <= id < vocab_size ({vocab_size})", tok
                )
    if "ignore_eos" in params and not isinstance(params["ignore_eos"], bool):
        raise InvalidRequest("sampling_params.ignore_eos", "a bool", params["ignore_eos"])
    priority = params.get("priority")
    if priority is not None and not _is_int(priority):
        raise InvalidRequest("sampling_params.priority", "an integer", priority)
    salt = params.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise InvalidRequest("sampling_params.cache_salt", "a non-empty string", salt)
    if params.get("logit_bias") is not None:
        params["logit_bias"] = _logit_bias(params["logit_bias"], vocab_size)
    # Every value, nested ones too (passthrough, structured_outputs...), as the data plane's JSON
    # carries it: the same request is refused alike through Ray and over the data plane.
    refuse_unencodable_params(params)
    return params


__all__ = [
    "validate_prompt",
    "validate_sampling_params",
    "validate_profile_options",
    "refuse_unencodable",
    "refuse_unencodable_params",
    "SAMPLING_KEYS",
    "PASSTHROUGH_KEY",
]
