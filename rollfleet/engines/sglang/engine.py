"""SGLangEngine: one replica drives one SGLang HTTP server (``sglang.launch_server``).

The engine either connects to a running server (``rollout.sglang.base_url``) or launches one on
its node's address and supervises it like every HTTP engine (:mod:`rollfleet.engines.http`: own
session, parent guard, exit watcher, busy-not-dead health grace). Everything goes through SGLang's
*native* HTTP API. Routes and fields as read in the sglang 0.5.23 release (PyPI; ``python/sglang/srt/``
``entrypoints/http_server.py``, ``managers/io_struct.py``, ``managers/tokenizer_manager.py``,
``managers/scheduler.py``), with the release that brought each (checked release by release):

* ``/health``, ``/health_generate`` (readiness of a launched server: it runs a generation),
  ``/get_model_info``, ``/get_server_info`` (newer servers rename them ``/model_info`` and
  ``/server_info`` and keep the old names as deprecated aliases; we try the old name, then the
  new one), ``/get_load``, ``/metrics``, ``/generate`` (``extra_key``: 0.5.3), ``/abort_request``;
* ``/pause_generation`` and ``/continue_generation`` (0.4.9; before, 404 and an abort of
  everything instead). ``PauseGenerationReqInput.mode`` (0.5.6; earlier servers ignore the body
  and abort): ``"abort"`` sets ``TokenizerManager.is_pause`` (new requests wait on
  ``is_pause_cond`` before they reach the scheduler) and aborts every registered request until none
  is left; ``"in_place"`` and ``"retract"`` set it too and stop the scheduler's loop, ``in_place``
  leaving running requests and their KV cache as they are, ``retract`` moving them back to the
  waiting queue with their KV freed (recomputed on continue);
* ``/update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``: ``model_path``, ``load_format``,
  ``abort_all_requests``, ``weight_version`` (0.5.1), ``flush_cache`` (0.5.6)...; while
  ``is_pause`` is set it loads at once, otherwise it waits for every running request under a
  writer lock), ``/flush_cache`` (refused with 400 while requests run: retried briefly),
  ``/release_memory_occupation`` and ``/resume_memory_occupation`` (``tags``: optional list of
  ``"weights"``, ``"kv_cache"``; None = all), ``/start_profile`` (``ProfileReq``: ``output_dir``,
  ``num_steps``, ``activities``...), ``/stop_profile``; answers carry ``meta_info.weight_versions``
  spans from 0.5.19.

Decisions:

* Weights (two-phase ``stage_weights``/``commit_weights``, ``keep``, per-token versions, the
  one-phase ``update_weights``): :mod:`.weights`.
* ``load()`` reads ``/metrics`` (has KV usage); if metrics are off (404) it falls back to
  ``/get_load``. In-flight tokens are the server's count (it sees every client).
* ``sleep`` aborts in-flight requests and holds new ones until ``wake_up``, independently of
  ``pause``'s hold (like the sim engine). It needs the server launched with
  ``--enable-memory-saver``; a server that refuses raises ``NotSupported`` naming the flag.
* ``rid`` is the caller's ``request_id`` with ``@`` and an id of its own (32 hex digits, unique
  across processes) after it: SGLang aborts every request whose rid *starts with* the one named
  (``abort("row-1")`` also ended ``row-10``... and a stale-connection retry ``x~r``), and refuses a
  rid it still holds (a request retried at once after a cancel, whose abort was still on its
  way). ``abort(request_id)`` aborts every call of that request.
* The vocabulary size is not reported by any SGLang route: it comes from
  ``rollout.sglang.vocab_size``, else the model's ``config.json`` (local folder or HF cache).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import orjson

from rollfleet.engines.base import EngineLimits, EngineLoad, replica_seed
from rollfleet.engines.http import HTTPEngine, metric_samples, read_vocab_size
from rollfleet.engines.http.inflight import DRAIN_TIMEOUT_S
from rollfleet.engines.sglang import wire
from rollfleet.engines.sglang.launch import SGLangLaunch
from rollfleet.engines.sglang.staging import Staged, StageFolders, default_root
from rollfleet.engines.sglang.weights import SGLangWeights
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported
from rollfleet.types import SamplingParams, TokenOutput
from rollfleet.utils.ids import unique_hex

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig

#: Timeout of control calls (abort, pause, flush, info); weight loads and generation get their own.
CONTROL_TIMEOUT_S = 60.0


class SGLangEngine(SGLangLaunch, SGLangWeights, HTTPEngine):
    """An SGLang server behind one replica (see the module docstring for the wire contract).

    ``stage_dir``/``stage_key``: where :meth:`stage_weights` writes (``<stage_dir>/<stage_key>/``;
    by default ``/dev/shm/rollfleet-weights`` (else the temp dir) and a key of this engine's own).
    Replicas of one fleet on one node that share a key write each version once.
    """

    name: ClassVar[str] = "sglang"
    server_name: ClassVar[str] = "SGLang server"
    ready_probe_s: ClassVar[float] = 30.0  # /health_generate runs a generation

    def __init__(
        self, *, model: str, base_url: Optional[str] = None, replica_id: str = "sglang-0", tp_size: int = 1,
        mem_fraction_static: float = 0.8, context_length: Optional[int] = None, vocab_size: Optional[int] = None,
        seed: Optional[int] = None, startup_timeout_s: float = 600.0, request_timeout_s: float = 600.0,
        probe_timeout_s: float = 2.0, extra_args: Optional[list[str]] = None, stage_dir: Optional[str] = None,
        stage_key: Optional[str] = None,
    ) -> None:  # fmt: skip
        super().__init__(
            label=replica_id, base_url=base_url, startup_timeout_s=startup_timeout_s, request_timeout_s=request_timeout_s,
            control_timeout_s=CONTROL_TIMEOUT_S, health_timeout_s=probe_timeout_s,
        )  # fmt: skip
        self.model, self.tp_size, self.mem_fraction_static = model, tp_size, mem_fraction_static
        self.context_length, self.vocab_size, self.seed = context_length, vocab_size, seed
        self.extra_args = list(extra_args or [])
        self._metrics_available: Optional[bool] = None
        self._profile_dir: Optional[str] = None
        self.stage = StageFolders(stage_dir or default_root(), stage_key or f"engine-{uuid.uuid4().hex[:12]}")
        self._staged: dict[int, Staged] = {}
        #: The label of the weights the server runs, as this engine set it: each request's
        #: ``extra_key`` (None: the weights it booted with, or a label someone else set).
        self._label: Optional[str] = None
        #: The labels this engine committed -> their versions: what ``token_versions`` may say.
        self._versions: dict[str, int] = {}
        self._reloads = itertools.count(1)
        #: ``keep`` commits begun: a request that saw one begin may have a token mislabelled.
        self._keep_commits = 0
        self._server_version: Optional[tuple[int, int, int]] = None
        self._overlap = True  # the server runs the overlap scheduler (SGLang's default)
        self._weights_lock = asyncio.Lock()  # one load at a time; pause/resume wait for a keep commit
        #: What the last stage and commit took (seconds, bytes, pause window), for operators and tests.
        self.last_stage: dict[str, Any] = {}
        self.last_commit: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: "RolloutConfig", replica_index: int) -> "SGLangEngine":
        sg = config.sglang
        return cls(
            model=config.model, base_url=sg.base_url, replica_id=f"sglang-{replica_index}", tp_size=sg.tp_size,
            mem_fraction_static=sg.mem_fraction_static, context_length=config.max_model_len,
            vocab_size=getattr(sg, "vocab_size", None), seed=replica_seed(config.seed, replica_index),
            startup_timeout_s=sg.startup_timeout_s,
            request_timeout_s=sg.request_timeout_s, probe_timeout_s=config.health.probe_timeout_s,
            extra_args=sg.extra_args, stage_dir=config.weight_sync.stage_dir,
            stage_key=config.weight_sync.stage_key,
        )  # fmt: skip

    @property
    def update_modes(self) -> frozenset[str]:  # type: ignore[override]  # a class constant elsewhere; here it depends on the server
        """``abort``, and ``keep`` once start found SGLang >= 0.5.7 (see the module docstring)."""
        if self._server_version is not None and self._server_version >= wire.KEEP_SINCE:
            return frozenset({"abort", "keep"})
        return frozenset({"abort"})

    @property
    def weight_label(self) -> Optional[str]:
        """The label of the weights the server runs, as this engine set it (None: boot weights)."""
        return self._label

    # ------------------------------------------------------------------ hooks
    def _ready_route(self) -> str:
        return "/health" if self.base_url is not None else "/health_generate"

    async def _discover_limits(self) -> EngineLimits:
        model_info = await self._get_json_first(("/get_model_info", "/model_info"))
        server_info = await self._get_json_first(("/get_server_info", "/server_info"))
        self._server_version = wire.server_version(server_info)
        self._overlap = wire.overlap_scheduled(server_info)
        running = model_info.get("weight_version") if isinstance(model_info, Mapping) else None
        self._label = running if isinstance(running, str) and running in self._versions else None
        max_len: Optional[int] = None
        if isinstance(server_info, Mapping):
            if isinstance(server_info.get("context_length"), int):
                max_len = server_info["context_length"]
            elif isinstance(server_info.get("max_req_input_len"), int):
                max_len = server_info["max_req_input_len"] + 1
        if max_len is None:
            max_len = self.context_length
        if max_len is None:
            raise EngineDead(self.replica_label, "cannot determine the context length (no /get_server_info)")
        vocab = self.vocab_size
        if vocab is None:
            served = model_info.get("model_path") if isinstance(model_info, Mapping) else None
            vocab = read_vocab_size(served) or read_vocab_size(self.model)
        if vocab is None:
            raise EngineDead(
                self.replica_label,
                "cannot determine the vocabulary size: SGLang does not report it and no config.json "
                "was found for the model; set rollout.sglang.vocab_size",
            )
        return EngineLimits(vocab_size=int(vocab), max_model_len=int(max_len))

    async def _get_json_first(self, paths: tuple[str, ...]) -> Any:
        for path in paths:
            resp = await self._request("GET", path, op="start")
            if resp.status_code == 200:
                try:
                    return resp.json()
                except ValueError:
                    return None
        return None

    def _build_request(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       extras: dict[str, Any]) -> tuple[dict[str, Any], Optional[int]]:  # fmt: skip
        """``priority`` (a keyword or a sampling key) is SGLang's request field; a caller's
        ``cache_salt`` joins the weight label in ``extra_key`` (SGLang's cache namespace) when the
        request goes out; other per-request extras are refused, as the vLLM adapter does (they
        were dropped without a word)."""
        params = wire.translate_sampling_params(sampling_params)
        body = wire.generate_body(prompt_ids, params, rid="")
        priority = extras.pop("priority", sampling_params.get("priority"))
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise InvalidRequest("priority", "an integer", priority)
            body["priority"] = priority
        if sampling_params.get("cache_salt"):  # validated by the replica: a non-empty string
            body["cache_salt"] = sampling_params["cache_salt"]
        if extras:
            raise InvalidRequest(next(iter(extras)), "not supported by the sglang engine adapter (text only)", "...")
        return body, params.get("max_new_tokens")

    def _wire_id(self, request_id: str) -> str:
        return f"{request_id}@{unique_hex()}"  # no rid of this engine's calls starts another's

    def _generate_call(self, wire_id: str, body: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        payload = {**body, "rid": wire_id}
        # past the gate: the label of the weights it will run on, and the caller's own salt apart
        # from it (joined by a character neither has: salt "1" on the boot weights, or "t.1" on
        # them, must not be version 1's namespace, unsalted or salted "t")
        salt = payload.pop("cache_salt", None)
        if salt is not None:
            payload["extra_key"] = f"{self._label or ''}\x00{salt}"
        elif self._label is not None:
            payload["extra_key"] = self._label
        return "/generate", orjson.dumps(payload), {"Content-Type": "application/json"}

    def _invalid(self, message: str, param: Any, prompt_ids: list[int], body: dict[str, Any]) -> InvalidRequest:
        return wire.invalid_request(message, param)

    def _parse_output(self, raw: bytes, budget: Optional[int]) -> TokenOutput:
        return wire.parse_generate(orjson.loads(raw), budget, self._versions)

    def _abort_requests(self, wire_ids: list[str], everything: bool) -> list[tuple[str, dict[str, Any]]]:
        return [("/abort_request", body) for body in wire.abort_bodies(wire_ids, everything)]

    async def _pause_server(self) -> bool:
        async with self._weights_lock:  # a keep commit in progress finishes first
            resp = await self._control("POST", "/pause_generation", op="pause", ok=False, json={"mode": "abort"})
        if resp.status_code == 404:  # servers before pause_generation: abort everything instead
            return False
        self._raise_for(resp, "pause")
        return True

    async def _resume_server(self) -> None:
        async with self._weights_lock:  # never in the middle of a keep commit
            resp = await self._control("POST", "/continue_generation", op="resume", ok=False, json={})
        if resp.status_code != 404:
            self._raise_for(resp, "resume")

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        commits = self._keep_commits
        out = await super().generate(request_id, prompt_ids, sampling_params, **kwargs)
        if out.token_versions is not None and self._keep_commits != commits and self._overlap:
            # In flight across a keep commit on the overlap scheduler: SGLang's span boundary may be
            # one token late (see the module docstring), so which weights sampled it is not exact.
            out.token_versions = None
        return out

    async def _server_load(self) -> EngineLoad:
        if self._metrics_available is not False:
            resp = await self._control("GET", "/metrics", op="load", ok=False)
            if resp.status_code == 200:
                load = wire.load_from_metrics(metric_samples(resp.text, wire.LOAD_METRICS))
                if load is not None:
                    self._metrics_available = True
                    return load
            self._metrics_available = False
        resp = await self._control("GET", "/get_load", op="load")
        return wire.load_from_get_load(resp.json())

    # ------------------------------------------------------------------ SGLang's own ops
    async def sleep(self) -> None:
        self._table.hold("sleep")
        try:
            await self._abort(self._table.sent(), everything=True)
            resp = await self._control("POST", "/release_memory_occupation", op="sleep", ok=False, json={})
            self._raise_unless_memory_saver(resp, "sleep", "/release_memory_occupation")
        except BaseException:
            self._release("sleep")
            raise

    async def wake_up(self) -> None:
        resp = await self._control("POST", "/resume_memory_occupation", op="wake_up", ok=False, json={})
        self._raise_unless_memory_saver(resp, "wake_up", "/resume_memory_occupation")
        self._release("sleep")

    def _raise_unless_memory_saver(self, resp: Any, op: str, route: str) -> None:
        if resp.status_code in (400, 404):
            message = resp.text.strip()[:500]
            raise NotSupported(
                self.name, op, f"server refused {route} ({message}); launch it with --enable-memory-saver"
            )
        self._raise_for(resp, op)

    # ------------------------------------------------------------------ weights
    async def clear_kv_cache(self) -> None:
        # SGLang refuses (400) while requests are running or waiting; retry briefly.
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            resp = await self._control("POST", "/flush_cache", op="clear_kv_cache", ok=False)
            if resp.status_code != 400 or time.monotonic() >= deadline:
                self._raise_for(resp, "clear_kv_cache")
                return
            await asyncio.sleep(0.05)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the server (see :meth:`HTTPEngine.shutdown`) and release this engine's staged files."""
        await super().shutdown(grace_s)
        self._staged.clear()
        await asyncio.to_thread(self.stage.release_all)

    async def start_profile(self, **kwargs: Any) -> None:
        body = dict(kwargs)
        if "trace_dir" in body:  # the name the sim engine uses
            body.setdefault("output_dir", body.pop("trace_dir"))
        await self._control("POST", "/start_profile", op="start_profile", json=body)
        self._profile_dir = body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR")

    async def stop_profile(self) -> Optional[str]:
        await self._control("POST", "/stop_profile", op="stop_profile")
        out, self._profile_dir = self._profile_dir, None
        return out


__all__ = ["SGLangEngine"]
