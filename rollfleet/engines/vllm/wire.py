"""vLLM's wire format: the completion request, its response, its errors (pure: no I/O).

HTTP details this relies on (verified against vLLM 0.32.0, CPU build):

* ``POST /v1/completions`` with ``prompt`` = list of token ids, ``return_token_ids: true``,
  ``logprobs: 0`` (and ``return_tokens_as_token_ids: true``, which spares the server a per-token
  decode) answers ``choices[0].token_ids`` (generated ids) and
  ``choices[0].logprobs.token_logprobs`` (logprob of each sampled token, same length) and
  ``finish_reason`` in ``stop | length | abort`` (vLLM also knows ``repetition``, and ``error``,
  which it turns into an HTTP 500); the mapping is :func:`rollfleet.engines.http.wire.stop_reason`;
* the request id is taken from the ``X-Request-Id`` header (else the ``request_id`` body field);
  the engine-side id is ``cmpl-<id>-0`` and that is what ``/abort_requests`` needs
  (``{"request_ids": [...]}``); a wrong id is answered ``{"status": "aborted"}`` and does nothing;
* an aborted request (``/abort_requests`` or ``/pause?mode=abort``) answers its HTTP request with
  ``finish_reason: "abort"`` and the tokens and logprobs generated so far; while paused, new
  requests are queued by the server and run after ``/resume``;
* a rejected request is answered 400 ``{"error": {"message", "type", "param", "code"}}``: ``param``
  names the offending field (``temperature``, ``input_tokens`` for a prompt longer than the
  context), or is null with "Token id N is out of vocabulary" for a bad prompt id;
* ``/metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1]), ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import orjson

from rollfleet.engines.http.wire import stop_reason
from rollfleet.errors import InvalidRequest
from rollfleet.types import SamplingParams, TokenOutput, budget_of

#: Keys of the request body that rollfleet sets itself; callers' values for them are ignored.
RESERVED_KEYS = frozenset(
    {"prompt", "model", "n", "stream", "stream_options", "echo", "return_token_ids", "logprobs",
     "request_id", "max_new_tokens", "use_beam_search", "best_of", "prompt_embeds", "suffix",
     "return_tokens_as_token_ids"}
)  # fmt: skip
#: ``param`` values vLLM uses for the prompt.
PROMPT_PARAMS = frozenset({"prompt", "prompt_token_ids", "input_ids", "prompt_ids", "input_tokens"})

METRIC_RUNNING = "vllm:num_requests_running"
METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_KV = "vllm:kv_cache_usage_perc"
#: stats() keys (as the sim engine names them) -> vLLM metric.
STATS_METRICS = {
    "prefix_cache_query_tokens": "vllm:prefix_cache_queries_total",
    "prefix_cache_hit_tokens": "vllm:prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "num_preemptions": "vllm:num_preemptions_total",
}
#: What a load poll parses out of /metrics.
LOAD_METRICS = (METRIC_RUNNING, METRIC_WAITING, METRIC_KV, *STATS_METRICS.values())


def header_safe(request_id: str) -> str:
    """A request id usable in an HTTP header (the engine-side id; rollfleet keeps the original)."""
    safe = "".join(c if (c.isascii() and (c.isalnum() or c in "-_.:")) else "_" for c in str(request_id))
    return safe[:128] or "req"


def engine_request_id(header_id: str) -> str:
    """The id vLLM registers a completion under, for the ``X-Request-Id`` we sent."""
    return f"cmpl-{header_id}-0"


def abort_body(header_ids: list[str]) -> dict[str, Any]:
    return {"request_ids": [engine_request_id(i) for i in header_ids]}


def completion_body(
    model: str, prompt_ids: list[int], sampling_params: SamplingParams, max_model_len: int
) -> tuple[dict[str, Any], int]:
    """(``/v1/completions`` body, token budget); the budget defaults to the rest of the context."""
    max_tokens = budget_of(sampling_params)
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    body: dict[str, Any] = {k: v for k, v in sampling_params.items() if k not in RESERVED_KEYS and v is not None}
    body.update(
        {
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": int(max_tokens),
            "n": 1,
            "stream": False,
            "return_token_ids": True,
            "logprobs": 0,  # the sampled token's logprob only
            # Token strings in the logprobs as "token_id:N": no per-token decode in vLLM's API
            # server (with decoding, building a batch of long responses stalls its event loop for
            # seconds on a small CPU).
            "return_tokens_as_token_ids": True,
        }
    )
    return body, int(max_tokens)


def invalid_request(message: str, param: Any, prompt_ids: list[int], body: dict[str, Any]) -> InvalidRequest:
    """The InvalidRequest for a 400/422 answer, naming the field vLLM complained about."""
    if param in (None, "") and "token id" in str(message).lower():
        where = "prompt_ids"  # "Token id N is out of vocabulary"
    elif param in (None, ""):
        where = "request"
    elif param in PROMPT_PARAMS:
        where = "prompt_ids"
    else:
        where = f"sampling_params.{param}"
    value = prompt_ids if where == "prompt_ids" else body.get(str(param)) if param else None
    return InvalidRequest(where, "accepted by the vLLM server", value, str(message)[:1000])


def parse_completion(raw: bytes, max_tokens: Optional[int]) -> TokenOutput:
    """A 200 answer of ``/v1/completions`` -> TokenOutput (ids and logprobs always aligned)."""
    data = orjson.loads(raw)
    choice = data["choices"][0]
    token_ids = [int(t) for t in (choice.get("token_ids") or [])]
    lp = choice.get("logprobs") or {}
    log_probs = lp.get("token_logprobs")
    if log_probs is not None:
        log_probs = [float(x) if x is not None else math.nan for x in log_probs]
        if len(log_probs) != len(token_ids):  # never seen; do not hand out misaligned data
            log_probs = None
    extra: dict[str, Any] = {}
    if choice.get("stop_reason") is not None:
        extra["vllm_stop_reason"] = choice["stop_reason"]
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        extra["cached_tokens"] = details["cached_tokens"]
    reason = stop_reason(choice.get("finish_reason"), len(token_ids), max_tokens)
    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=reason, extra_fields=extra)


__all__ = [
    "RESERVED_KEYS",
    "STATS_METRICS",
    "LOAD_METRICS",
    "header_safe",
    "engine_request_id",
    "abort_body",
    "completion_body",
    "invalid_request",
    "parse_completion",
]
