"""The SGLang engine: one replica drives one SGLang HTTP server (``sglang.launch_server``).

The engine either connects to a running server (``rollout.sglang.base_url``) or launches
``python -m sglang.launch_server`` on loopback in its own process session and supervises it.
Everything goes through SGLang's *native* HTTP API: ``/generate`` (the hot path) with an
``aiohttp`` session and orjson, every control route with an ``httpx.AsyncClient``. (httpx spent
~3.7 ms of CPU per completion at 64 requests in flight on a 2-core machine, aiohttp ~0.2 ms: with
httpx one replica process tops out near 270 requests/s.)

Wire shapes, and where they come from (sgl-project/sglang; commits are the ones read):

* Routes: ``python/sglang/srt/entrypoints/http_server.py`` @ 0025436eab05 (``/health``,
  ``/health_generate``, ``/get_model_info``, ``/get_server_info``, ``/get_load``, ``/generate``,
  ``/flush_cache``, ``/start_profile``, ``/stop_profile``, ``/update_weights_from_disk``,
  ``/update_weights_from_tensor``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
  ``/abort_request``, ``/pause_generation``, ``/continue_generation``). Newer servers rename
  ``/get_model_info`` -> ``/model_info`` and ``/get_server_info`` -> ``/server_info`` and keep the old
  names as deprecated aliases; we try the old name, then the new one. Error bodies: a request that
  fails validation is answered ``400 {"error": {"message": ...}}`` (``_create_error_response``) or,
  for schema errors, ``400 {"object": "error", "message": ..., "param": ..., "code": 400}``.
* Request bodies: ``python/sglang/srt/managers/io_struct.py`` @ 001067fffe33:
  ``GenerateReqInput`` (``input_ids``, ``sampling_params``, ``rid``, ``return_logprob``,
  ``logprob_start_len`` (-1 = output tokens only), ``stream``), ``AbortReq`` (``rid``,
  ``abort_all``), ``PauseGenerationReqInput`` (``mode``: ``"abort" | "retract" | "in_place"``,
  default ``"abort"``; older servers' route takes no body and ignores one),
  ``ContinueGenerationReqInput`` (all fields defaulted), ``UpdateWeightFromDiskReqInput``
  (``model_path``, ``load_format``, ``abort_all_requests``, ``weight_version``, ``flush_cache``...),
  ``Release/ResumeMemoryOccupationReqInput`` (``tags``: optional list of ``"weights"``,
  ``"kv_cache"``; None = all), ``ProfileReq`` fields for ``/start_profile``
  (``output_dir``, ``num_steps``, ``activities``, ``with_stack``, ``record_shapes``...).
* Sampling parameters: ``python/sglang/srt/sampling/sampling_params.py`` @ 00c17cafcb9e
  (``max_new_tokens``, ``min_new_tokens``, ``stop``, ``stop_token_ids``, ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``,
  ``ignore_eos``, ``sampling_seed``, ``logit_bias``, ``json_schema``/``regex``/``ebnf``...).
* ``/generate`` response: ``python/sglang/srt/managers/tokenizer_manager.py`` @ 001067fffe33
  (``_handle_batch_output`` / ``_handle_abort_req``): ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
  "output_token_logprobs": [[logprob, token_id, text|null], ...], ...}}``. ``finish_reason`` is
  ``BaseFinishReason.to_json()`` from ``python/sglang/srt/managers/schedule_batch.py``:
  ``{"type": "stop", "matched": id|str}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message", "status_code", "err_type"}``. An aborted request answers 200 with
  the tokens generated so far (``output_ids`` and their logprobs).
* Pause: ``TokenizerManager.pause_generation(mode="abort")`` sets ``is_pause`` (new requests wait
  on ``is_pause_cond``) and aborts every registered request until none is left;
  ``continue_generation`` clears it.
* Load: ``/get_load`` answers a list with one entry per DP rank ``{"dp_rank", "num_reqs",
  "num_waiting_reqs", "num_tokens"}`` (newer servers add ``num_pending_tokens`` and mean the KV
  capacity by ``num_tokens``); Prometheus gauges on ``/metrics`` (only with ``--enable-metrics``,
  names from ``python/sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``, ``sglang:token_usage``.

Decisions:

* ``finish_reason`` -> ``stop_reason``: ``stop`` -> ``stop``, ``length`` -> ``length``, ``abort`` ->
  ``aborted`` (an abort carrying ``status_code`` 400 is a rejected input: ``InvalidRequest``).
  A missing/None finish reason (the server did not say why it ended) is ``length`` when the token
  budget was used up, else ``aborted``: the tokens are kept and the request can be resumed, which
  is safe, while calling it ``stop`` would silently truncate the trajectory.
* Token ids come from ``output_ids``; logprobs from ``output_token_logprobs``. If their lengths
  disagree, the ids of the logprob triples are used so ids and logprobs always align.
* ``update_weights(path)`` -> ``/update_weights_from_disk``. A mapping with ``model_path`` is sent
  as an ``UpdateWeightFromDiskReqInput``. In-memory state dicts raise ``NotSupported``:
  ``/update_weights_from_tensor`` takes tensors serialised with SGLang's
  ``MultiprocessingSerializer`` (CUDA IPC handles, base64 in JSON) that only a process on the same
  node and GPUs can produce; it belongs with a colocated trainer, not here.
* ``load()`` reads ``/metrics`` (has KV usage); if metrics are off (404) it falls back to
  ``/get_load`` (KV usage only when the server reports capacity).
* ``pause`` also holds new ``generate`` calls inside the engine (they never reach the server)
  until ``resume``; ``sleep`` aborts in-flight requests and holds new ones until ``wake_up``. The two
  holds are independent, like the sim engine. ``abort``/``abort_all`` also release held calls
  (they return ``aborted`` with no tokens).
* ``rid`` is the caller's ``request_id``; if that id is already in flight on this engine (SGLang
  rejects duplicate rids) a ``#n`` suffix is added; ``abort(request_id)`` aborts all of them.
* Sleep needs the server launched with ``--enable-memory-saver`` (pass it in ``extra_args``); a
  server that refuses raises ``NotSupported`` naming the flag.
* The vocabulary size is not reported by any SGLang route: it comes from
  ``rollout.sglang.vocab_size``, else the model's ``config.json`` (local folder or HF cache).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import aiohttp
import httpx
import orjson

from rollfleet.engines.base import Engine, EngineHealth, EngineLimits, EngineLoad
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported, ReplicaUnavailable
from rollfleet.types import SamplingParams, TokenOutput, budget_of

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig

logger = logging.getLogger(__name__)

#: Connect timeout of every call: a server that does not accept within it is treated as gone.
CONNECT_TIMEOUT_S = 5.0
#: Timeout of control calls (abort, pause, flush, info); weight loads and generation get their own.
CONTROL_TIMEOUT_S = 60.0
#: Our idle connections expire before the server's (uvicorn's default keep-alive is 5 s).
KEEPALIVE_S = 2.0
#: Bounded waits for aborted requests to come back (pause, abort_all, abort, sleep).
DRAIN_TIMEOUT_S = 5.0
#: How often an abort is re-sent while its request is still out (covers a request in transit).
ABORT_RESEND_S = 0.1
#: Lines of the server log shown when a launched server fails.
LOG_TAIL_LINES = 60

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
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "custom_params",
    }
)
# Keys other engines understand that have no SGLang counterpart or are implied by the engine
# (logprobs are always requested, output is always token ids). Dropped silently.
_IGNORED_KEYS: frozenset[str] = frozenset(
    {
        "logprobs",
        "prompt_logprobs",
        "detokenize",
        "include_stop_str_in_output",
        "return_tokens_as_token_ids",
        "output_kind",
        "best_of",
        "use_beam_search",
    }
)
# SGLang sampling key -> the field name callers know, for InvalidRequest.field.
_FIELD_NAMES: dict[str, str] = {
    "max_new_tokens": "sampling_params.max_tokens",
    "min_new_tokens": "sampling_params.min_tokens",
    "sampling_seed": "sampling_params.seed",
}


def translate_sampling_params(sampling_params: SamplingParams) -> dict[str, Any]:
    """Translate rollfleet sampling parameters into SGLang's ``sampling_params`` (a new dict).

    The caller's dict is never mutated. Unknown keys are dropped (SGLang rejects unexpected
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
                raise InvalidRequest(
                    "sampling_params.n", "== 1 (one engine call returns one sample)", value
                )
            continue
        if key in _RENAMED_KEYS:
            out[_RENAMED_KEYS[key]] = value
        elif key in _PASSTHROUGH_KEYS:
            out[key] = list(value) if key == "stop_token_ids" else value
        elif key in _IGNORED_KEYS:
            continue
        else:
            logger.debug("sglang engine: dropping sampling parameter %r (no SGLang counterpart)", key)
    return out


def normalize_finish_reason(finish_reason: Any, num_tokens: int, budget: Optional[int]) -> str:
    """Map SGLang's ``meta_info.finish_reason`` to ``stop | length | aborted`` (see module doc)."""
    kind = finish_reason.get("type") if isinstance(finish_reason, Mapping) else finish_reason
    if kind == "stop":
        return "stop"
    if kind == "length":
        return "length"
    if kind == "abort":
        return "aborted"
    if budget is not None and num_tokens >= budget:
        return "length"
    return "aborted"


def _field_from_message(message: str, param: Any = None) -> str:
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


def _error_message(resp: httpx.Response) -> tuple[str, Any]:
    """(message, param) of an SGLang error response, whatever its body shape."""
    return _error_message_of(resp.status_code, resp.content)


def _error_message_of(status: int, raw: bytes) -> tuple[str, Any]:
    try:
        body = orjson.loads(raw)
    except ValueError:
        return (raw.decode("utf-8", "replace").strip() or f"HTTP {status}"), None
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            return str(err.get("message", err)), err.get("param")
        if "message" in body:
            return str(body["message"]), body.get("param")
        if "detail" in body:
            return str(body["detail"]), None
    return str(body), None


def _parse_prometheus(text: str) -> dict[str, list[float]]:
    """Sample values by metric name (label sets ignored) from Prometheus text exposition."""
    values: dict[str, list[float]] = collections.defaultdict(list)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if match is None:
            continue
        try:
            values[match.group(1)].append(float(match.group(3)))
        except ValueError:
            continue
    return values


def _vocab_from_hf_config(model_path: Optional[str]) -> Optional[int]:
    """``vocab_size`` from a model's config.json: a local folder, else the Hugging Face cache."""
    if not model_path:
        return None
    candidates: list[Path] = []
    local = Path(model_path).expanduser()
    if local.is_dir():
        candidates.append(local / "config.json")
    else:
        try:  # no network: only what is already cached
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_path, "config.json")
            if isinstance(cached, str):
                candidates.append(Path(cached))
        except Exception:  # noqa: BLE001 - optional dependency / odd repo ids
            pass
    for path in candidates:
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for section in (cfg, cfg.get("text_config") or {}, cfg.get("llm_config") or {}):
            if isinstance(section, Mapping) and isinstance(section.get("vocab_size"), int):
                return int(section["vocab_size"])
    return None


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class _Inflight:
    """One ``generate`` call between entry and return."""

    request_id: str
    rid: str
    held: bool = True  # waiting at the engine's gate, not sent yet
    aborted: bool = False  # aborted while held
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class SGLangEngine(Engine):
    """An SGLang server behind one replica (see the module docstring for the wire contract)."""

    name: ClassVar[str] = "sglang"

    def __init__(
        self,
        *,
        model: str,
        base_url: Optional[str] = None,
        replica_id: str = "sglang-0",
        tp_size: int = 1,
        mem_fraction_static: float = 0.8,
        context_length: Optional[int] = None,
        vocab_size: Optional[int] = None,
        seed: Optional[int] = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        probe_timeout_s: float = 2.0,
        extra_args: Optional[list[str]] = None,
    ) -> None:
        self.model = model
        self.replica_id = replica_id
        self._base_url = base_url.rstrip("/") if base_url else None
        self._launch = base_url is None
        self._tp_size = tp_size
        self._mem_fraction_static = mem_fraction_static
        self._context_length = context_length
        self._vocab_size = vocab_size
        self._seed = seed
        self._startup_timeout_s = startup_timeout_s
        self._request_timeout_s = request_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._extra_args = list(extra_args or [])

        self._client: Optional[httpx.AsyncClient] = None  # control routes
        self._session: Optional[aiohttp.ClientSession] = None  # /generate
        self._process: Optional[subprocess.Popen] = None
        self._log_path: Optional[Path] = None
        self._limits: Optional[EngineLimits] = None
        self._closed = False

        self._inflight: dict[str, _Inflight] = {}  # rid -> call
        self._rids: dict[str, set[str]] = collections.defaultdict(set)  # request_id -> rids
        self._paused = False
        self._asleep = False
        self._gate: Optional[asyncio.Event] = None  # set = serving; created lazily in the loop
        self._metrics_available: Optional[bool] = None
        self._profile_dir: Optional[str] = None

    # ------------------------------------------------------------------ construction / lifecycle

    @classmethod
    def from_config(cls, config: "RolloutConfig", replica_index: int) -> "SGLangEngine":
        sg = config.sglang
        return cls(
            model=config.model,
            base_url=sg.base_url,
            replica_id=f"sglang-{replica_index}",
            tp_size=sg.tp_size,
            mem_fraction_static=sg.mem_fraction_static,
            context_length=config.max_model_len,
            vocab_size=getattr(sg, "vocab_size", None),
            seed=config.seed,
            startup_timeout_s=sg.startup_timeout_s,
            request_timeout_s=sg.request_timeout_s,
            probe_timeout_s=config.health.probe_timeout_s,
            extra_args=sg.extra_args,
        )

    def address(self) -> str:
        return self._base_url or f"{self.name}://not-started"

    async def start(self) -> None:
        if self._client is not None:
            return
        self._closed = False
        self._update_gate()
        if self._launch:
            port = _free_port(self.bind_host)
            self._base_url = f"http://{self.bind_host}:{port}"
            self._spawn(port)
        # Idle connections expire before uvicorn's 5 s keep-alive: never reuse one it is closing.
        self._session = aiohttp.ClientSession(
            base_url=self._base_url,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self._request_timeout_s, sock_connect=CONNECT_TIMEOUT_S),
        )
        self._client = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=httpx.Timeout(CONTROL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S),
            trust_env=False,
        )
        try:
            await self._wait_ready("/health_generate" if self._launch else "/health")
            self._limits = await self._discover_limits()
        except BaseException:
            await self.shutdown()
            raise

    async def shutdown(self) -> None:
        self._closed = True
        if self._gate is not None:
            self._gate.set()
        for entry in list(self._inflight.values()):
            entry.wake.set()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        proc, self._process = self._process, None
        if proc is not None and proc.poll() is None:
            await asyncio.to_thread(self._terminate, proc)

    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise ReplicaUnavailable(self.replica_id, "limits are known once start() has returned")
        return self._limits

    # ------------------------------------------------------------------ launching

    def _launch_command(self, port: int) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model,
            "--host", self.bind_host,
            "--port", str(port),
            "--tp-size", str(self._tp_size),
            "--mem-fraction-static", str(self._mem_fraction_static),
            "--enable-metrics",
        ]  # fmt: skip
        if self._context_length is not None:
            cmd += ["--context-length", str(self._context_length)]
        if self._seed is not None:
            cmd += ["--random-seed", str(self._seed)]
        return cmd + self._extra_args

    def _launch_env(self) -> dict[str, str]:
        """The server's environment: exactly the devices placement gave this replica."""
        env = dict(os.environ)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        return env

    def _spawn(self, port: int) -> None:
        fd, path = tempfile.mkstemp(prefix=f"rollfleet-{self.replica_id}-", suffix=".log")
        self._log_path = Path(path)
        with os.fdopen(fd, "wb") as log:
            self._process = subprocess.Popen(
                self._launch_command(port),
                env=self._launch_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: shutdown kills the whole tree
            )
        logger.info("sglang %s: launched pid %d on port %d, log %s", self.replica_id, self._process.pid, port, path)

    def _log_tail(self) -> str:
        if self._log_path is None:
            return ""
        try:
            lines = self._log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    @staticmethod
    def _terminate(proc: subprocess.Popen) -> None:
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def _process_exit_code(self) -> Optional[int]:
        return None if self._process is None else self._process.poll()

    async def _wait_ready(self, path: str) -> None:
        assert self._client is not None
        deadline = time.monotonic() + self._startup_timeout_s
        last = "no answer yet"
        while True:
            code = self._process_exit_code()
            if code is not None:
                raise EngineDead(
                    self.replica_id,
                    f"sglang.launch_server exited with code {code} during start-up; log tail:\n{self._log_tail()}",
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f"SGLang server at {self._base_url} not ready after {self._startup_timeout_s:.1f}s ({last})"
                if self._launch:
                    detail += f"; log tail:\n{self._log_tail()}"
                raise EngineDead(self.replica_id, detail)
            try:
                resp = await self._client.get(path, timeout=httpx.Timeout(max(0.1, min(remaining, 30.0)), connect=min(remaining, CONNECT_TIMEOUT_S)))
                if resp.status_code == 200:
                    return
                last = f"{path} answered {resp.status_code}"
            except httpx.HTTPError as exc:
                last = f"{path}: {type(exc).__name__}"
            await asyncio.sleep(min(0.5, max(0.05, deadline - time.monotonic())))

    async def _discover_limits(self) -> EngineLimits:
        model_info = await self._get_json_first(("/get_model_info", "/model_info"))
        server_info = await self._get_json_first(("/get_server_info", "/server_info"))
        max_len: Optional[int] = None
        if isinstance(server_info, Mapping):
            if isinstance(server_info.get("context_length"), int):
                max_len = server_info["context_length"]
            elif isinstance(server_info.get("max_req_input_len"), int):
                max_len = server_info["max_req_input_len"] + 1
        if max_len is None:
            max_len = self._context_length
        if max_len is None:
            raise EngineDead(self.replica_id, "cannot determine the context length (no /get_server_info)")
        vocab = self._vocab_size
        if vocab is None:
            served = model_info.get("model_path") if isinstance(model_info, Mapping) else None
            vocab = _vocab_from_hf_config(served) or _vocab_from_hf_config(self.model)
        if vocab is None:
            raise EngineDead(
                self.replica_id,
                "cannot determine the vocabulary size: SGLang does not report it and no config.json "
                "was found for the model; set rollout.sglang.vocab_size",
            )
        return EngineLimits(vocab_size=int(vocab), max_model_len=int(max_len))

    async def _get_json_first(self, paths: tuple[str, ...]) -> Any:
        for path in paths:
            resp = await self._call("GET", path, op="start")
            if resp.status_code == 200:
                try:
                    return resp.json()
                except ValueError:
                    return None
        return None

    # ------------------------------------------------------------------ HTTP plumbing

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise ReplicaUnavailable(self.replica_id, "engine is not started" if not self._closed else "engine is shut down")
        return self._client

    async def _post_generate(self, payload: dict[str, Any]) -> tuple[int, bytes]:
        self._require_client()
        session = self._session
        if session is None or session.closed:
            raise ReplicaUnavailable(self.replica_id, "generate: engine is shut down")
        try:
            async with session.post(
                "/generate", data=orjson.dumps(payload), headers={"Content-Type": "application/json"}
            ) as resp:
                return resp.status, await resp.read()
        except asyncio.TimeoutError as exc:
            raise ReplicaUnavailable(self.replica_id, f"generate: timed out after {self._request_timeout_s:.0f}s") from exc
        except aiohttp.ClientError as exc:
            raise self._transport_error("generate", exc) from exc
        except RuntimeError as exc:  # session closed under us (shutdown during a call)
            raise ReplicaUnavailable(self.replica_id, f"generate: {exc}") from exc

    def _transport_error(self, op: str, exc: Exception) -> ReplicaUnavailable:
        code = self._process_exit_code()
        if code is not None:
            return EngineDead(self.replica_id, f"{op}: sglang server exited with code {code}; log tail:\n{self._log_tail()}")
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, aiohttp.ClientConnectorError)):
            return EngineDead(self.replica_id, f"{op}: cannot connect to {self._base_url} ({type(exc).__name__}: {exc})")
        if isinstance(exc, httpx.TimeoutException):
            return ReplicaUnavailable(self.replica_id, f"{op}: timed out ({type(exc).__name__})")
        return ReplicaUnavailable(self.replica_id, f"{op}: connection to {self._base_url} failed ({type(exc).__name__}: {exc})")

    async def _call(
        self, method: str, path: str, *, op: str, json_body: Any = None, timeout: Optional[httpx.Timeout] = None
    ) -> httpx.Response:
        client = self._require_client()
        try:
            kwargs: dict[str, Any] = {}
            if json_body is not None:
                kwargs["json"] = json_body
            if timeout is not None:
                kwargs["timeout"] = timeout
            return await client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._transport_error(op, exc) from exc
        except RuntimeError as exc:  # client closed under us (shutdown during a call)
            raise ReplicaUnavailable(self.replica_id, f"{op}: {exc}") from exc

    def _raise_for_status(self, resp: httpx.Response, op: str) -> None:
        if resp.status_code < 400:
            return
        # 5xx, 408/429 and unexpected 4xx on control routes: the replica cannot do it right now.
        message, _ = _error_message(resp)
        raise ReplicaUnavailable(self.replica_id, f"{op}: HTTP {resp.status_code}: {message}")

    # ------------------------------------------------------------------ gate (pause / sleep holds)

    def _ensure_gate(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._update_gate()
        return self._gate

    def _update_gate(self) -> None:
        if self._gate is None:
            return
        if self._closed or not (self._paused or self._asleep):
            self._gate.set()
        else:
            self._gate.clear()

    async def _pass_gate(self, entry: _Inflight) -> None:
        gate = self._ensure_gate()
        while not gate.is_set() and not entry.aborted and not self._closed:
            entry.wake.clear()
            gate_wait = asyncio.ensure_future(gate.wait())
            wake_wait = asyncio.ensure_future(entry.wake.wait())
            try:
                await asyncio.wait({gate_wait, wake_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gate_wait.cancel()
                wake_wait.cancel()
        if self._closed:
            raise ReplicaUnavailable(self.replica_id, "engine shut down while the request was held")

    # ------------------------------------------------------------------ data plane

    def _new_rid(self, request_id: str) -> str:
        rid, n = request_id, 1
        while rid in self._inflight:
            rid = f"{request_id}#{n}"
            n += 1
        return rid

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        self._require_client()
        sglang_params = translate_sampling_params(sampling_params)
        budget = sglang_params.get("max_new_tokens")
        entry = _Inflight(request_id=request_id, rid=self._new_rid(request_id))
        self._inflight[entry.rid] = entry
        self._rids[request_id].add(entry.rid)
        try:
            await self._pass_gate(entry)
            if entry.aborted:
                return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
            entry.held = False
            payload = {
                "input_ids": list(prompt_ids),
                "sampling_params": sglang_params,
                "rid": entry.rid,
                "return_logprob": True,
                "logprob_start_len": -1,
                "stream": False,
            }
            status, raw = await self._post_generate(payload)
            if status in (400, 422):
                message, param = _error_message_of(status, raw)
                raise InvalidRequest(_field_from_message(message, param), "accepted by the SGLang server", None, message)
            if status >= 400:
                message, _ = _error_message_of(status, raw)
                raise ReplicaUnavailable(self.replica_id, f"generate: HTTP {status}: {message}")
            try:
                body = orjson.loads(raw)
            except ValueError:
                raise ReplicaUnavailable(self.replica_id, f"generate: response is not JSON: {raw[:200]!r}") from None
            return self._parse_generate(body, budget)
        finally:
            self._inflight.pop(entry.rid, None)
            rids = self._rids.get(request_id)
            if rids is not None:
                rids.discard(entry.rid)
                if not rids:
                    del self._rids[request_id]

    def _parse_generate(self, body: Any, budget: Optional[int]) -> TokenOutput:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, Mapping):
            raise ReplicaUnavailable(self.replica_id, f"generate: unexpected response {str(body)[:200]!r}")
        meta = body.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, Mapping) and finish.get("type") == "abort" and finish.get("status_code") == 400:
            message = str(finish.get("message", "rejected"))
            raise InvalidRequest(_field_from_message(message), "accepted by the SGLang server", None, message)
        token_ids = [int(t) for t in (body.get("output_ids") or [])]
        triples = meta.get("output_token_logprobs")
        log_probs: Optional[list[float]] = None
        if isinstance(triples, list):
            log_probs = [float(t[0]) if t[0] is not None else math.nan for t in triples]
            if len(log_probs) != len(token_ids):
                logger.warning(
                    "sglang %s: %d output_ids but %d logprobs; using the logprob token ids",
                    self.replica_id, len(token_ids), len(log_probs),
                )
                token_ids = [int(t[1]) for t in triples]
        stop_reason = normalize_finish_reason(finish, len(token_ids), budget)
        extra: dict[str, Any] = {"engine_finish_reason": finish}
        for key in ("prompt_tokens", "cached_tokens", "weight_version"):
            if key in meta:
                extra[f"engine_{key}"] = meta[key]
        preempted = meta.get("num_retractions", meta.get("total_retractions", 0)) or 0
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason=stop_reason,
            num_preempted=int(preempted),
            extra_fields=extra,
        )

    def _sent_rids(self, rids: Optional[set[str]] = None) -> list[str]:
        pool = self._inflight if rids is None else {r: self._inflight[r] for r in rids if r in self._inflight}
        return [rid for rid, e in pool.items() if not e.held]

    def _release_held(self, rids: Optional[set[str]] = None) -> int:
        count = 0
        for rid in list(self._inflight if rids is None else rids):
            entry = self._inflight.get(rid)
            if entry is not None and entry.held and not entry.aborted:
                entry.aborted = True
                entry.wake.set()
                count += 1
        return count

    async def _abort_and_drain(self, body: dict[str, Any], rids: set[str]) -> None:
        """Send ``body`` to /abort_request, then wait (bounded) until the sent requests among
        ``rids`` (a snapshot taken by the caller) are back. A request still out after
        ``ABORT_RESEND_S`` may have been in transit when the abort landed (SGLang ignores rids it
        has not registered yet): it gets its own abort again. Requests that arrive later are left
        alone."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        first = True
        while True:
            out = self._sent_rids(rids)
            if not out:
                return
            if time.monotonic() >= deadline:
                logger.warning("sglang %s: %d aborted requests still out after %.1fs", self.replica_id, len(out), DRAIN_TIMEOUT_S)
                return
            bodies = [body] if first else [{"rid": rid} for rid in out]
            first = False
            for resp in await asyncio.gather(
                *(self._call("POST", "/abort_request", op="abort", json_body=b) for b in bodies)
            ):
                self._raise_for_status(resp, "abort")
            end = min(deadline, time.monotonic() + ABORT_RESEND_S)
            while self._sent_rids(rids) and time.monotonic() < end:
                await asyncio.sleep(0.005)

    async def abort(self, request_id: str) -> None:
        rids = set(self._rids.get(request_id, ()))
        if not rids:
            return
        self._release_held(rids)
        for rid in rids:
            if rid in self._sent_rids({rid}):
                await self._abort_and_drain({"rid": rid}, {rid})

    async def abort_all(self) -> int:
        snapshot = set(self._inflight)
        if not snapshot:
            return 0
        self._release_held(snapshot)
        if self._sent_rids(snapshot):
            await self._abort_and_drain({"rid": "", "abort_all": True}, snapshot)
        return len(snapshot)

    async def _wait_drained(self, rids: set[str]) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self._sent_rids(rids) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def pause(self) -> None:
        self._ensure_gate()
        self._paused = True
        self._update_gate()
        sent = set(self._sent_rids())  # nothing new is sent once the gate is closed
        resp = await self._call("POST", "/pause_generation", op="pause", json_body={"mode": "abort"})
        if resp.status_code == 404:  # servers before pause_generation: abort everything instead
            if sent:
                await self._abort_and_drain({"rid": "", "abort_all": True}, sent)
            return
        self._raise_for_status(resp, "pause")
        # The server returns once it has aborted every registered request; wait for them to be
        # back here. A request still in transit is held by the server (is_pause) until resume.
        await self._wait_drained(sent)

    async def resume(self) -> None:
        resp = await self._call("POST", "/continue_generation", op="resume", json_body={})
        if resp.status_code != 404:
            self._raise_for_status(resp, "resume")
        self._ensure_gate()
        self._paused = False
        self._update_gate()

    async def sleep(self) -> None:
        self._ensure_gate()
        self._asleep = True
        self._update_gate()
        try:
            sent = set(self._sent_rids())
            if sent:
                await self._abort_and_drain({"rid": "", "abort_all": True}, sent)
            resp = await self._call("POST", "/release_memory_occupation", op="sleep", json_body={})
            if resp.status_code in (400, 404):
                message, _ = _error_message(resp)
                raise NotSupported(
                    self.name, "sleep",
                    f"server refused /release_memory_occupation ({message}); launch it with --enable-memory-saver",
                )  # fmt: skip
            self._raise_for_status(resp, "sleep")
        except BaseException:
            self._asleep = False
            self._update_gate()
            raise

    async def wake_up(self) -> None:
        resp = await self._call("POST", "/resume_memory_occupation", op="wake_up", json_body={})
        if resp.status_code in (400, 404):
            message, _ = _error_message(resp)
            raise NotSupported(self.name, "wake_up", f"server refused /resume_memory_occupation ({message})")
        self._raise_for_status(resp, "wake_up")
        self._ensure_gate()
        self._asleep = False
        self._update_gate()

    async def update_weights(self, weights: Any) -> None:
        if isinstance(weights, (str, os.PathLike)):
            body: dict[str, Any] = {"model_path": os.fspath(weights)}
        elif isinstance(weights, Mapping) and isinstance(weights.get("model_path"), (str, os.PathLike)):
            body = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in weights.items()}
        else:
            raise NotSupported(
                self.name,
                "update_weights",
                "only checkpoint paths (/update_weights_from_disk) are supported; in-memory state dicts "
                "need /update_weights_from_tensor with MultiprocessingSerializer payloads from a process "
                "on the same node",
            )
        resp = await self._call(
            "POST",
            "/update_weights_from_disk",
            op="update_weights",
            json_body=body,
            timeout=httpx.Timeout(self._request_timeout_s, connect=CONNECT_TIMEOUT_S),
        )
        if resp.status_code == 400:
            message, _ = _error_message(resp)
            raise InvalidRequest("weights", "a checkpoint the SGLang server can load", body["model_path"], message)
        self._raise_for_status(resp, "update_weights")
        try:
            result = resp.json()
        except ValueError:
            result = None
        if isinstance(result, Mapping) and result.get("success") is False:
            raise InvalidRequest("weights", "a checkpoint the SGLang server can load", body["model_path"], str(result.get("message")))

    async def clear_kv_cache(self) -> None:
        # SGLang refuses (400) while requests are running or waiting; retry briefly.
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            resp = await self._call("POST", "/flush_cache", op="clear_kv_cache")
            if resp.status_code == 200:
                return
            if resp.status_code != 400 or time.monotonic() >= deadline:
                message, _ = _error_message(resp)
                raise ReplicaUnavailable(self.replica_id, f"clear_kv_cache: HTTP {resp.status_code}: {message}")
            await asyncio.sleep(0.05)

    async def start_profile(self, **kwargs: Any) -> None:
        body = dict(kwargs)
        if "trace_dir" in body:  # the name the sim engine uses
            body.setdefault("output_dir", body.pop("trace_dir"))
        resp = await self._call("POST", "/start_profile", op="start_profile", json_body=body)
        self._raise_for_status(resp, "start_profile")
        self._profile_dir = body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR")

    async def stop_profile(self) -> Optional[str]:
        resp = await self._call("POST", "/stop_profile", op="stop_profile")
        self._raise_for_status(resp, "stop_profile")
        out, self._profile_dir = self._profile_dir, None
        return out

    # ------------------------------------------------------------------ health and load

    async def health(self) -> EngineHealth:
        code = self._process_exit_code()
        if code is not None:
            return EngineHealth(False, f"sglang server exited with code {code}")
        if self._client is None:
            return EngineHealth(False, "not started" if not self._closed else "shut down")
        try:
            resp = await self._client.get("/health", timeout=httpx.Timeout(self._probe_timeout_s))
        except httpx.HTTPError as exc:
            return EngineHealth(False, f"/health: {type(exc).__name__}: {exc}")
        except RuntimeError as exc:
            return EngineHealth(False, str(exc))
        if resp.status_code != 200:
            return EngineHealth(False, f"/health answered {resp.status_code}")
        return EngineHealth(True)

    async def load(self) -> EngineLoad:
        if self._metrics_available is not False:
            resp = await self._call("GET", "/metrics", op="load")
            if resp.status_code == 200:
                metrics = _parse_prometheus(resp.text)
                if "sglang:num_running_reqs" in metrics:
                    self._metrics_available = True
                    return EngineLoad(
                        running=int(sum(metrics.get("sglang:num_running_reqs", [0.0]))),
                        waiting=int(sum(metrics.get("sglang:num_queue_reqs", [0.0]))),
                        inflight_tokens=int(sum(metrics.get("sglang:num_used_tokens", [0.0]))),
                        kv_usage=float(max(metrics.get("sglang:token_usage", [0.0]))),
                    )
            self._metrics_available = False
        resp = await self._call("GET", "/get_load", op="load")
        self._raise_for_status(resp, "load")
        body = resp.json()
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


__all__ = ["SGLangEngine", "translate_sampling_params", "normalize_finish_reason"]
