"""SGLang's native wire format: ``/generate`` bodies and answers, errors, load (pure: no I/O).

Shapes and where they come from (sgl-project/sglang; commits are the ones read):

* Request bodies: ``python/sglang/srt/managers/io_struct.py`` @ 001067fffe33:
  ``GenerateReqInput`` (``input_ids``, ``sampling_params``, ``rid``, ``return_logprob``,
  ``logprob_start_len`` (-1 = output tokens only), ``stream``), ``AbortReq`` (``rid``,
  ``abort_all``).
* Sampling parameters: ``python/sglang/srt/sampling/sampling_params.py`` @ 00c17cafcb9e
  (``max_new_tokens``, ``min_new_tokens``, ``stop``, ``stop_token_ids``, ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``,
  ``ignore_eos``, ``sampling_seed``, ``logit_bias``, ``json_schema``/``regex``/``ebnf``...). SGLang
  rejects keys it does not know, so unknown keys are dropped here.
* ``/generate`` response: ``python/sglang/srt/managers/tokenizer_manager.py`` @ 001067fffe33
  (``_handle_batch_output`` / ``_handle_abort_req``): ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
  "output_token_logprobs": [[logprob, token_id, text|null], ...], ...}}``. ``finish_reason`` is
  ``BaseFinishReason.to_json()`` from ``python/sglang/srt/managers/schedule_batch.py``:
  ``{"type": "stop", "matched": id|str}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message", "status_code", "err_type"}``. An aborted request answers 200 with
  the tokens generated so far (``output_ids`` and their logprobs); an abort carrying
  ``status_code`` 400 is a rejected input (``InvalidRequest``). ``type`` maps to ``stop_reason``
  by :func:`rollfleet.engines.http.wire.stop_reason`.
* Token ids come from ``output_ids``; logprobs from ``output_token_logprobs``. If their lengths
  disagree, the ids of the logprob triples are used so ids and logprobs always align.
* Weight versions (sglang >= 0.5.19, ``python/sglang/srt/utils/weight_versions.py``): a finished or
  aborted request's ``meta_info`` has ``weight_versions``, spans ``[{"version", "start", "end"}]``
  over the output tokens (the scheduler records, at every weight update, how many output ids each
  live request had under the old label), and ``weight_version`` is the last span's label (older
  servers: the server's label when the answer was built). :func:`token_versions` turns spans
  into ``TokenOutput.token_versions`` when every label is a version the engine committed.
* Weight updates: ``/update_weights_from_disk`` takes ``UpdateWeightFromDiskReqInput``
  (``model_path``, ``abort_all_requests``, ``weight_version`` (>= 0.5.1), ``flush_cache``
  (>= 0.5.6; before, the scheduler flushed after every load and asserted that it could)...;
  unknown keys are ignored) and answers ``{"success", "message", "num_paused_requests"}``, 400
  when ``success`` is false. ``/get_server_info`` (``/server_info``) has ``version`` and the
  server arguments, among them ``disable_overlap_schedule`` (nested in newer servers).
* Load: ``/get_load`` answers a list with one entry per DP rank ``{"dp_rank", "num_reqs",
  "num_waiting_reqs", "num_tokens"}`` (newer servers add ``num_pending_tokens`` and mean the KV
  capacity by ``num_tokens``); Prometheus gauges on ``/metrics`` (only with ``--enable-metrics``,
  names from ``python/sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``, ``sglang:token_usage``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any, Optional

from rollfleet.engines.base import EngineLoad
from rollfleet.engines.http.wire import stop_reason
from rollfleet.errors import InvalidRequest
from rollfleet.types import SamplingParams, TokenOutput, budget_of

logger = logging.getLogger(__name__)

# rollfleet/verl sampling key -> SGLang sampling key (sampling_params.py).
_RENAMED_KEYS: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "min_new_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "sampling_seed": "sampling_seed",
}
# Keys SGLang takes as they are.
_PASSTHROUGH_KEYS: frozenset[str] = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
     "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos", "skip_special_tokens",
     "spaces_between_special_tokens", "no_stop_trim", "json_schema", "regex", "ebnf", "structural_tag",
     "logit_bias", "custom_params"}
)  # fmt: skip
# Keys other engines understand that have no SGLang counterpart or are implied by the engine
# (logprobs are always requested, output is always token ids). Dropped silently.
_IGNORED_KEYS: frozenset[str] = frozenset(
    {"logprobs", "prompt_logprobs", "detokenize", "include_stop_str_in_output", "return_tokens_as_token_ids",
     "output_kind", "best_of", "use_beam_search",
     "priority", "cache_salt"}  # request fields, not sampling ones: the engine sends them (_build_request)
)  # fmt: skip
# Keys that change what is sampled and that SGLang has no counterpart for: refused, not dropped
# (a request that asked to ban words or restrict ids must not be sampled without it).
_UNSUPPORTED_KEYS: frozenset[str] = frozenset({"bad_words", "allowed_token_ids", "truncate_prompt_tokens"})
# SGLang sampling key -> the field name callers know, for InvalidRequest.field.
_FIELD_NAMES: dict[str, str] = {
    "max_new_tokens": "sampling_params.max_tokens",
    "min_new_tokens": "sampling_params.min_tokens",
    "sampling_seed": "sampling_params.seed",
}
LOAD_METRICS = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage")


def translate_sampling_params(sampling_params: SamplingParams) -> dict[str, Any]:
    """Translate rollfleet sampling parameters into SGLang's ``sampling_params`` (a new dict).

    The caller's dict is never mutated. A key that changes what is sampled and has no SGLang
    counterpart is refused naming it; other unknown keys are dropped (SGLang rejects unexpected
    keys); ``n`` must be 1 because one engine call returns one sample.
    """
    out: dict[str, Any] = {}
    budget = budget_of(sampling_params)
    if budget is not None:
        out["max_new_tokens"] = int(budget)
    for key, value in sampling_params.items():
        if value is None or key in ("max_tokens", "max_new_tokens"):
            continue
        if key == "n":
            if int(value) != 1:
                raise InvalidRequest("sampling_params.n", "== 1 (one engine call returns one sample)", value)
            continue
        if key in _RENAMED_KEYS:
            out[_RENAMED_KEYS[key]] = value
        elif key in _PASSTHROUGH_KEYS:
            out[key] = list(value) if key == "stop_token_ids" else value
        elif key == "structured_outputs":
            out.update(_constraint(value))
        elif key in _UNSUPPORTED_KEYS:
            raise InvalidRequest(f"sampling_params.{key}", "a key SGLang has (this one is vLLM's alone)", value)
        elif key not in _IGNORED_KEYS:
            logger.debug("sglang engine: dropping sampling parameter %r (no SGLang counterpart)", key)
    return out


def _constraint(structured: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` as SGLang's keys (``json_schema`` is a string there)."""
    if structured.get("json") is not None:
        schema = structured["json"]
        return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
    if structured.get("json_object"):
        return {"json_schema": json.dumps({"type": "object"})}
    if structured.get("regex") is not None:
        return {"regex": structured["regex"]}
    if structured.get("choice") is not None:
        return {"regex": "|".join(re.escape(str(c)) for c in structured["choice"])}
    if structured.get("grammar") is not None:
        return {"ebnf": structured["grammar"]}
    if structured.get("structural_tag") is not None:
        return {"structural_tag": structured["structural_tag"]}
    raise InvalidRequest("sampling_params.structured_outputs", "one constraint SGLang supports", structured)


def generate_body(prompt_ids: list[int], sglang_params: dict[str, Any], rid: str) -> dict[str, Any]:
    return {
        "input_ids": list(prompt_ids),
        "sampling_params": sglang_params,
        "rid": rid,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }


def abort_bodies(rids: list[str], everything: bool) -> list[dict[str, Any]]:
    """``AbortReq`` bodies: one per rid, or one that aborts every request of the server."""
    return [{"rid": "", "abort_all": True}] if everything else [{"rid": rid} for rid in rids]


def normalize_finish_reason(finish_reason: Any, num_tokens: int, budget: Optional[int]) -> str:
    """Map SGLang's ``meta_info.finish_reason`` (a dict, or its ``type``) to ``stop | length | aborted``."""
    kind = finish_reason.get("type") if isinstance(finish_reason, Mapping) else finish_reason
    return stop_reason(kind, num_tokens, budget)


def field_from_message(message: str, param: Any = None) -> str:
    """Best-effort name of the offending field in an SGLang 400 message."""
    if isinstance(param, str) and param:
        return _FIELD_NAMES.get(param, f"sampling_params.{param}" if param in _PASSTHROUGH_KEYS else param)
    low = message.lower()
    if "context length" in low or "input_ids" in low or "vocab" in low or "input (" in low or "prompt" in low:
        return "prompt_ids"
    # The sampling key named first in the message (whole words; the longer key wins a tie).
    best: Optional[tuple[int, int, str]] = None
    for key in set(_RENAMED_KEYS.values()) | _PASSTHROUGH_KEYS:
        match = re.search(rf"\b{re.escape(key)}\b", low)
        if match is not None and (best is None or (match.start(), -len(key)) < best[:2]):
            best = (match.start(), -len(key), key)
    if best is not None:
        return _FIELD_NAMES.get(best[2], f"sampling_params.{best[2]}")
    return "request"


def invalid_request(message: str, param: Any = None) -> InvalidRequest:
    return InvalidRequest(field_from_message(message, param), "accepted by the SGLang server", None, message)


#: The first SGLang release whose ``/pause_generation`` takes ``mode="in_place"`` and whose
#: ``/update_weights_from_disk`` takes ``flush_cache`` (both 0.5.6) and applies ``weight_version``
#: while the server is paused (0.5.7; 0.5.6 returned early without it). What ``keep`` needs.
KEEP_SINCE: tuple[int, int, int] = (0, 5, 7)


def server_version(info: Any) -> Optional[tuple[int, int, int]]:
    """SGLang's release from ``/get_server_info``'s ``version`` (``"0.5.23"``, ``"0.5.5.post3"``,
    ``"0.5.24.dev3+g1a2b"``); None when absent or unreadable. (A source build without version
    metadata says ``"0.0.0.dev0"``: it reads as older than everything.)"""
    version = info.get("version") if isinstance(info, Mapping) else None
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version)) if version is not None else None
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def overlap_scheduled(info: Any) -> bool:
    """Whether the server runs the overlap scheduler (SGLang's default): False only when
    ``disable_overlap_schedule`` is true, at the top of ``/get_server_info`` or one level down
    (newer servers nest their arguments by group)."""
    if not isinstance(info, Mapping):
        return True
    if "disable_overlap_schedule" in info:
        return not bool(info["disable_overlap_schedule"])
    for value in info.values():
        if isinstance(value, Mapping) and "disable_overlap_schedule" in value:
            return not bool(value["disable_overlap_schedule"])
    return True


def update_body(model_path: str, label: str, *, keep: bool) -> dict[str, Any]:
    """``UpdateWeightFromDiskReqInput`` of a commit. ``abort_all_requests``: abort mode (the caller
    paused; anything still running is aborted, as the mode says), never keep. ``flush_cache``
    false in both: keep's frozen requests make SGLang refuse a flush, which fails the whole call
    after the weights loaded (0.5.22 on: "Weights were updated, but the cache was not flushed";
    0.5.6 to 0.5.21: an ``assert`` that takes the scheduler down); abort mode flushes with
    ``/flush_cache`` right after, retrying while SGLang still says busy."""
    return {"model_path": model_path, "weight_version": label, "abort_all_requests": not keep, "flush_cache": False}


def load_touched_weights(message: str) -> bool:
    """Whether a failed ``/update_weights_from_disk`` got as far as writing weights: SGLang answers
    "Failed to update weights: ... Rolling back to original weights." when ``load_weights``
    raised midway; its rollback reads the new ``model_path`` again, so the weights are in an unknown
    state. Any other failure ("Failed to get weights iterator: Cannot find any model weights...",
    "Failed to get model loader") left them untouched."""
    return "Failed to update weights" in message


def token_versions(spans: Any, n: int, versions: Mapping[str, int]) -> Optional[list[int]]:
    """``TokenOutput.token_versions`` from SGLang's ``weight_versions`` spans over ``n`` output
    tokens: every token's label must be one of ``versions`` (the labels the engine committed:
    ``str(version)`` -> version), and the spans must cover every token once. None otherwise: no
    spans (older servers), tokens from the weights the server booted with (``"default"``; the
    replica knows that version, and ``token_versions`` holds ints), or labels someone else set."""
    if not isinstance(spans, list):
        return None
    out: list[Optional[int]] = [None] * n
    for span in spans:
        if not isinstance(span, Mapping):
            return None
        try:
            start, end, label = int(span["start"]), int(span["end"]), str(span["version"])
        except (KeyError, TypeError, ValueError):
            return None
        if label not in versions or not 0 <= start <= end <= n:
            return None
        for i in range(start, end):
            if out[i] is not None:
                return None
            out[i] = versions[label]
    if any(v is None for v in out):
        return None
    return [v for v in out if v is not None]


def parse_generate(body: Any, budget: Optional[int], versions: Optional[Mapping[str, int]] = None) -> TokenOutput:
    """A 200 answer of ``/generate`` -> TokenOutput; ValueError when it is not one. ``versions``:
    the labels the engine committed, to read per-token versions from (see :func:`token_versions`)."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, Mapping):
        raise ValueError(f"not a /generate answer: {str(body)[:200]!r}")
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason")
    if isinstance(finish, Mapping) and finish.get("type") == "abort" and finish.get("status_code") == 400:
        raise invalid_request(str(finish.get("message", "rejected")))
    token_ids = [int(t) for t in (body.get("output_ids") or [])]
    triples = meta.get("output_token_logprobs")
    log_probs: Optional[list[float]] = None
    if isinstance(triples, list):
        log_probs = [float(t[0]) if t[0] is not None else math.nan for t in triples]
        if len(log_probs) != len(token_ids):
            logger.warning(
                "sglang: %d output_ids but %d logprobs; using the logprob token ids", len(token_ids), len(log_probs)
            )
            token_ids = [int(t[1]) for t in triples]
    extra: dict[str, Any] = {"engine_finish_reason": finish}
    for key in ("prompt_tokens", "cached_tokens", "weight_version"):
        if key in meta:
            extra[f"engine_{key}"] = meta[key]
    preempted = meta.get("num_retractions", meta.get("total_retractions", 0)) or 0
    spans = meta.get("weight_versions")
    if spans is not None:
        extra["engine_weight_versions"] = spans
    return TokenOutput(
        token_ids=token_ids,
        log_probs=log_probs,
        stop_reason=normalize_finish_reason(finish, len(token_ids), budget),
        num_preempted=int(preempted),
        token_versions=token_versions(spans, len(token_ids), versions) if versions else None,
        extra_fields=extra,
    )


def load_from_metrics(samples: Mapping[str, list[float]]) -> Optional[EngineLoad]:
    """EngineLoad from ``/metrics`` samples (per label set), or None when SGLang's gauges are absent."""
    if "sglang:num_running_reqs" not in samples:
        return None
    return EngineLoad(
        running=int(sum(samples.get("sglang:num_running_reqs", [0.0]))),
        waiting=int(sum(samples.get("sglang:num_queue_reqs", [0.0]))),
        inflight_tokens=int(sum(samples.get("sglang:num_used_tokens", [0.0]))),
        kv_usage=float(max(samples.get("sglang:token_usage", [0.0]))),
    )


def load_from_get_load(body: Any) -> EngineLoad:
    """EngineLoad from ``/get_load`` (KV usage only when the server reports its capacity)."""
    ranks = body if isinstance(body, list) else [body]
    running = waiting = tokens = capacity = 0
    for rank in ranks:
        if not isinstance(rank, Mapping):
            continue
        rank_waiting = int(rank.get("num_waiting_reqs", 0) or 0)
        if "num_running_reqs" in rank:
            rank_running = int(rank["num_running_reqs"] or 0)
        else:
            rank_running = int(rank.get("num_reqs", 0) or 0) - rank_waiting
        running += max(0, rank_running)
        waiting += rank_waiting
        num_tokens = int(rank.get("num_tokens", 0) or 0)
        if "num_pending_tokens" in rank:  # newer shim: num_tokens = capacity, pending = free
            capacity += num_tokens
            tokens += num_tokens - int(rank["num_pending_tokens"] or 0)
        else:  # classic: tokens in use plus waiting prompt tokens
            tokens += num_tokens
    kv_usage = tokens / capacity if capacity > 0 else 0.0
    return EngineLoad(running=running, waiting=waiting, inflight_tokens=tokens, kv_usage=kv_usage)
