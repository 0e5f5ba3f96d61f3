"""vLLM's wire format: the generate and completion requests, their responses, errors (pure: no I/O).

HTTP details this relies on (verified against vLLM 0.32.0, CPU build; see also
``docs/vllm-rl-api-on-cpu.md``):

* ``POST /inference/v1/generate`` (token ids in and out; exists with ``--enable-scale-out``, else it
  answers 403) takes ``{"token_ids", "sampling_params": <vLLM SamplingParams as JSON>, "stream",
  "output_mode": "tokens", "cache_salt", "priority"}`` and answers ``choices[0].token_ids``,
  ``choices[0].logprobs.content[i].logprob`` (with ``sampling_params.logprobs: 0``: the sampled
  token's), ``finish_reason`` (``stop | length | abort``), ``stop_reason`` (the matched stop id) and
  ``weight_versions``: ``[{"version", "start", "end"}]`` spans over the output tokens, the label of
  the weights each token was sampled with (``"default"`` until the first
  ``/finish_weight_update {"weight_version"}``; the engine labels its commits ``str(version)``). Unknown sampling keys are ignored; stop strings
  need ``detokenize: true`` (a 400 otherwise), which is the only reason to let the server decode;
* the request id comes from the ``X-Request-Id`` header; vLLM registers it as
  ``generate-tokens-<id>``, and ``/abort_requests`` ``{"request_ids": [...]}`` (dev mode) aborts it by
  that name, the request then answering ``finish_reason: "abort"`` with its partial tokens;
* rejected generate input is answered 400 with ``param`` ``temperature``, ``top_p``,
  ``max_tokens``... for a sampling field, ``body.token_ids`` for a schema error, or null with
  "Token id N is out of vocabulary" / "The decoder prompt (length N) is longer than the maximum
  model length";
* ``POST /v1/completions`` (used against a server rollfleet did not launch, which may lack
  ``--enable-scale-out``) with ``prompt`` = list of token ids, ``return_token_ids: true``,
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

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any, Optional

import orjson

from rollfleet.engines.http.wire import stop_reason
from rollfleet.engines.vllm.sampling import vllm_sampling_params
from rollfleet.errors import InvalidRequest
from rollfleet.types import SamplingParams, TokenDelta, TokenOutput, budget_of

#: Keys of the request body that rollfleet sets itself; callers' values for them are ignored.
RESERVED_KEYS = frozenset(
    {"prompt", "model", "n", "stream", "stream_options", "echo", "return_token_ids", "logprobs",
     "request_id", "max_new_tokens", "use_beam_search", "best_of", "prompt_embeds", "suffix",
     "return_tokens_as_token_ids"}
)  # fmt: skip
#: ``param`` values vLLM uses for the prompt.
PROMPT_PARAMS = frozenset({"prompt", "prompt_token_ids", "input_ids", "prompt_ids", "input_tokens", "token_ids"})
#: Phrases of vLLM's null-``param`` messages about the prompt.
PROMPT_MESSAGES = ("token id", "decoder prompt", "maximum model length", "maximum context length")
#: Sampling keys rollfleet sets itself in a generate request (the caller's are ignored), and keys
#: of the caller's sampling parameters that are not sampling parameters (request-level fields of
#: ``/v1/completions``, which took them in the same body).
GENERATE_RESERVED = frozenset(
    {"n", "logprobs", "max_tokens", "max_new_tokens", "output_kind", "prompt", "model", "stream",
     "stream_options", "echo", "return_token_ids", "request_id", "use_beam_search", "best_of",
     "prompt_embeds", "suffix", "return_tokens_as_token_ids", "priority", "cache_salt"}
)  # fmt: skip
#: vLLM's label of the weights a server booted with.
BOOT_VERSION = "default"
#: Routes of the RL API (dev mode, ``--weight-transfer-config``).
GENERATE_ROUTE = "/inference/v1/generate"

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


def engine_request_id(header_id: str, generate: bool = False) -> str:
    """The id vLLM registers a request under, for the ``X-Request-Id`` we sent: a completion as
    ``cmpl-<id>-0``, a generate request as ``generate-tokens-<id>``."""
    return f"generate-tokens-{header_id}" if generate else f"cmpl-{header_id}-0"


def abort_body(header_ids: list[str], generate: bool = False) -> dict[str, Any]:
    return {"request_ids": [engine_request_id(i, generate) for i in header_ids]}


def generate_body(
    prompt_ids: list[int], sampling_params: SamplingParams, max_model_len: int
) -> tuple[dict[str, Any], int]:
    """(``/inference/v1/generate`` body, token budget); the budget defaults to the rest of the context.

    ``priority`` and ``cache_salt`` among the sampling parameters go to the request, as
    ``/v1/completions`` took them; the body is sent :func:`salted`."""
    truncate = sampling_params.get("truncate_prompt_tokens")
    if truncate is not None:  # a request field of /v1/completions; this route's SamplingParams drops it
        raise InvalidRequest(
            "sampling_params.truncate_prompt_tokens",
            f"unset on vLLM's {GENERATE_ROUTE} route (it has no such field: the whole prompt would be used)",
            truncate,
        )
    max_tokens = budget_of(sampling_params)
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    sp = {k: v for k, v in vllm_sampling_params(sampling_params).items() if k not in GENERATE_RESERVED}
    sp.update({"max_tokens": int(max_tokens), "n": 1, "logprobs": 0})  # logprobs 0: the sampled token's
    if not sp.get("stop"):
        # Token ids only: the server need not decode every token (only stop strings need text).
        sp.setdefault("detokenize", False)
    body: dict[str, Any] = {"token_ids": list(prompt_ids), "sampling_params": sp, "stream": False,
                            "output_mode": "tokens"}  # fmt: skip
    for key in ("priority", "cache_salt"):
        if sampling_params.get(key) is not None:
            body[key] = sampling_params[key]
    return body, int(max_tokens)


def salted(body: dict[str, Any], label: str) -> dict[str, Any]:
    """``body`` with ``cache_salt`` = the weight label (after the caller's own salt, if any).

    vLLM hashes prefix-cache blocks with the salt, so a request never reuses KV computed under
    another one. Salted with the label of the weights it will run on, a request sent after an
    update that kept the cache (``keep``) cannot hit blocks the old weights computed, while the
    requests of one version still share their prefixes. A salt vLLM would find too long (over
    :data:`MAX_CACHE_SALT` characters once the label is added) goes as a digest of the caller's:
    equal salts stay equal, and a valid request is not refused for what rollfleet added. A label
    vLLM would refuse in a salt (an attached server's, such as ``org/model@step-100``: no ``/``,
    ``@`` or ``\\``) goes as a digest of it too."""
    if not _SAFE_LABEL.fullmatch(label):
        label = hashlib.sha256(label.encode()).hexdigest()[:32]
    own = body.get("cache_salt")
    if not own:
        return {**body, "cache_salt": label}
    salt = f"{own}.{label}"
    if len(salt) > MAX_CACHE_SALT:
        salt = f"{hashlib.sha256(str(own).encode()).hexdigest()}.{label}"
    return {**body, "cache_salt": salt}


#: The longest ``cache_salt`` vLLM takes (``generate/base/protocol.py``).
MAX_CACHE_SALT = 128
#: A weight label that goes into a salt as it is: short, and none of the characters vLLM refuses.
_SAFE_LABEL = re.compile(r"[A-Za-z0-9._~+:=-]{1,48}")


def completion_body(
    model: str, prompt_ids: list[int], sampling_params: SamplingParams, max_model_len: int
) -> tuple[dict[str, Any], int]:
    """(``/v1/completions`` body, token budget); the budget defaults to the rest of the context."""
    max_tokens = budget_of(sampling_params)
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    body = {k: v for k, v in vllm_sampling_params(sampling_params).items() if k not in RESERVED_KEYS}
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
    """The InvalidRequest for a 400/422 answer, naming the field vLLM complained about (of a
    completion or a generate body: a generate request's sampling fields are nested)."""
    field = str(param or "")
    for prefix in ("body.sampling_params.", "body.", "sampling_params."):
        field = field.removeprefix(prefix)
    field = field.split(".")[0].split("[")[0]
    if not field:
        where = "prompt_ids" if any(p in str(message).lower() for p in PROMPT_MESSAGES) else "request"
    elif field in PROMPT_PARAMS:
        where = "prompt_ids"
    elif field == "sampling_params":
        where = "sampling_params"
    elif field in ("cache_salt", "priority"):
        where = field
    else:
        where = f"sampling_params.{field}"
    sampling = body.get("sampling_params")
    fields = sampling if isinstance(sampling, dict) else body
    value = prompt_ids if where == "prompt_ids" else fields.get(field, body.get(field)) if field else None
    return InvalidRequest(where, "accepted by the vLLM server", value, str(message)[:1000])


def _extra_fields(data: Mapping[str, Any], choice: Mapping[str, Any]) -> dict[str, Any]:
    """What both answer shapes add to ``extra_fields``: vLLM's own stop reason (the stop string or
    token that ended it) and the prompt tokens served from its prefix cache."""
    extra: dict[str, Any] = {}
    if choice.get("stop_reason") is not None:
        extra["vllm_stop_reason"] = choice["stop_reason"]
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        extra["cached_tokens"] = details["cached_tokens"]
    return extra


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
    extra = _extra_fields(data, choice)
    reason = stop_reason(choice.get("finish_reason"), len(token_ids), max_tokens)
    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=reason, extra_fields=extra)


def token_labels(spans: Any, n: int) -> Optional[list[Optional[str]]]:
    """The weight label of each of ``n`` output tokens, from vLLM's ``weight_versions`` spans
    (``[{"version", "start", "end"}]``); None where the server sent none; a token no span covers
    (never seen) gets None."""
    if not isinstance(spans, list):
        return None
    labels: list[Optional[str]] = [None] * n
    for span in spans:
        start, end = max(0, int(span["start"])), min(n, int(span["end"]))
        for i in range(start, end):
            labels[i] = str(span["version"])
    return labels


def label_version(label: Optional[str]) -> Optional[int]:
    """A weight label as rollfleet's integer version: the labels the engine commits are
    ``str(version)``; anything else (vLLM's boot label ``"default"``, a label someone else set)
    is None: the engine cannot tell which version those weights are."""
    if label is None or not (label.isascii() and label.isdigit()):
        return None
    return int(label)


def token_versions(spans: Any, n: int) -> Optional[list[Optional[int]]]:
    """``TokenOutput.token_versions`` from vLLM's spans: the version of each token, None for a token
    of the weights the server booted with (label ``"default"``: the replica knows their version).
    None as a whole when the server sent no spans, or when a label is neither (weights loaded by
    ``reload_weights``, or labelled by someone else): which version sampled them is unknown."""
    labels = token_labels(spans, n)
    if labels is None or any(label is None for label in labels):
        return None
    versions = [label_version(label) for label in labels]
    if any(v is None and label != BOOT_VERSION for v, label in zip(versions, labels)):
        return None
    return versions


def parse_generate(raw: bytes, max_tokens: Optional[int]) -> TokenOutput:
    """A 200 answer of ``/inference/v1/generate`` -> TokenOutput (ids, logprobs and versions aligned)."""
    data = orjson.loads(raw)
    choice = data["choices"][0]
    token_ids = [int(t) for t in (choice.get("token_ids") or [])]
    content = (choice.get("logprobs") or {}).get("content")
    log_probs: Optional[list[float]] = None
    if content is not None and len(content) == len(token_ids):  # never seen otherwise: no misaligned data
        log_probs = [float(c["logprob"]) if c.get("logprob") is not None else math.nan for c in content]
    extra = _extra_fields(data, choice)
    return TokenOutput(
        token_ids=token_ids,
        log_probs=log_probs,
        stop_reason=stop_reason(choice.get("finish_reason"), len(token_ids), max_tokens),
        token_versions=token_versions(choice.get("weight_versions"), len(token_ids)),
        extra_fields=extra,
    )


class GenerateStream:
    """One streamed ``/inference/v1/generate`` answer (``"stream": true``), read line by line.

    Each ``data:`` chunk carries the new ``token_ids`` and their ``logprobs.content``; the last one
    the ``finish_reason`` and the ``weight_versions`` spans over the whole output. :meth:`body`
    puts them back together as the whole answer would have been, for :func:`parse_generate`."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.content: list[dict[str, Any]] = []
        self.top: dict[str, Any] = {}
        self.ending: dict[str, Any] = {}

    def request_fields(self) -> dict[str, Any]:
        # The usage (with the prompt tokens the prefix cache served) comes only when asked for,
        # in a last chunk without choices.
        return {"stream_options": {"include_usage": True}}

    def feed(self, line: bytes) -> Optional[TokenDelta]:
        line = line.strip()
        if not line.startswith(b"data:"):
            return None
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return None
        data = orjson.loads(payload)
        if "error" in data:
            raise ValueError(f"the stream ended with an error: {data['error']}")
        if not self.top:
            self.top = {k: v for k, v in data.items() if k != "choices"}
        if data.get("usage") is not None:
            self.top["usage"] = data["usage"]
        if not data.get("choices"):
            return None
        choice = data["choices"][0]
        for key in ("finish_reason", "stop_reason", "weight_versions"):
            if choice.get(key) is not None:
                self.ending[key] = choice[key]
        new = [int(t) for t in (choice.get("token_ids") or [])]
        content = (choice.get("logprobs") or {}).get("content") or []
        self.token_ids += new
        self.content += content
        if not new:
            return None
        logprobs = [float(c["logprob"]) if c.get("logprob") is not None else math.nan for c in content]
        if len(logprobs) != len(new):
            logprobs = [math.nan] * len(new)
        return TokenDelta(new, logprobs, [])  # versions unknown until the end (spans): none, not None (boot)

    def body(self) -> bytes:
        choice = {"index": 0, "token_ids": self.token_ids, "logprobs": {"content": self.content}, **self.ending}
        choice.setdefault("finish_reason", "abort")  # a stream that ended without saying why was cut
        return orjson.dumps({**self.top, "choices": [choice]})


__all__ = [
    "GenerateStream",
    "GENERATE_ROUTE",
    "BOOT_VERSION",
    "generate_body",
    "salted",
    "parse_generate",
    "token_labels",
    "label_version",
    "token_versions",
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
