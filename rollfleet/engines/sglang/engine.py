"""SGLangEngine: one replica drives one SGLang HTTP server (``sglang.launch_server``).

The engine either connects to a running server (``rollout.sglang.base_url``) or launches one on
its node's address and supervises it like every HTTP engine (:mod:`rollfleet.engines.http`: own
session, parent guard, exit watcher, busy-not-dead health grace). Everything goes through SGLang's
*native* HTTP API; routes from ``python/sglang/srt/entrypoints/http_server.py`` @ 0025436eab05:

* ``/health``, ``/health_generate`` (readiness of a launched server: it runs a generation),
  ``/get_model_info``, ``/get_server_info`` (newer servers rename them ``/model_info`` and
  ``/server_info`` and keep the old names as deprecated aliases; we try the old name, then the
  new one), ``/get_load``, ``/metrics``, ``/generate``, ``/abort_request``;
* ``/pause_generation`` (``PauseGenerationReqInput``: ``mode`` ``"abort" | "retract" | "in_place"``;
  ``TokenizerManager.pause_generation(mode="abort")`` sets ``is_pause``, so new requests wait on
  ``is_pause_cond``, and aborts every registered request until none is left) and
  ``/continue_generation``; servers before them answer 404 and get an abort of everything instead;
* ``/update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``: ``model_path``, ``load_format``,
  ``abort_all_requests``, ``weight_version``, ``flush_cache``...), ``/flush_cache`` (refused with 400
  while requests run: retried briefly), ``/release_memory_occupation`` and
  ``/resume_memory_occupation`` (``tags``: optional list of ``"weights"``, ``"kv_cache"``; None =
  all), ``/start_profile`` (``ProfileReq``: ``output_dir``, ``num_steps``, ``activities``...),
  ``/stop_profile``.

Decisions:

* ``update_weights(path)`` -> ``/update_weights_from_disk``; a mapping with ``model_path`` is sent as
  an ``UpdateWeightFromDiskReqInput``. In-memory state dicts raise ``NotSupported``:
  ``/update_weights_from_tensor`` takes tensors serialised with SGLang's
  ``MultiprocessingSerializer`` (CUDA IPC handles, base64 in JSON) that only a process on the same
  node and GPUs can produce; it belongs with a colocated trainer, not here.
* ``load()`` reads ``/metrics`` (has KV usage); if metrics are off (404) it falls back to
  ``/get_load``. In-flight tokens are the server's count (it sees every client).
* ``sleep`` aborts in-flight requests and holds new ones until ``wake_up``, independently of
  ``pause``'s hold (like the sim engine). It needs the server launched with
  ``--enable-memory-saver``; a server that refuses raises ``NotSupported`` naming the flag.
* ``rid`` is the caller's ``request_id``; if that id is already in flight on this engine (SGLang
  rejects duplicate rids) a ``#n`` suffix is added; ``abort(request_id)`` aborts all of them.
* The vocabulary size is not reported by any SGLang route: it comes from
  ``rollout.sglang.vocab_size``, else the model's ``config.json`` (local folder or HF cache).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import orjson

from rollfleet.engines.base import EngineLimits, EngineLoad
from rollfleet.engines.http import HTTPEngine, metric_samples, read_vocab_size
from rollfleet.engines.http.inflight import DRAIN_TIMEOUT_S
from rollfleet.engines.sglang import wire
from rollfleet.engines.sglang.launch import SGLangLaunch
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported
from rollfleet.types import SamplingParams, TokenOutput

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig

#: Timeout of control calls (abort, pause, flush, info); weight loads and generation get their own.
CONTROL_TIMEOUT_S = 60.0


class SGLangEngine(SGLangLaunch, HTTPEngine):
    """An SGLang server behind one replica (see the module docstring for the wire contract)."""

    name: ClassVar[str] = "sglang"
    server_name: ClassVar[str] = "SGLang server"
    ready_probe_s: ClassVar[float] = 30.0  # /health_generate runs a generation

    def __init__(
        self, *, model: str, base_url: Optional[str] = None, replica_id: str = "sglang-0", tp_size: int = 1,
        mem_fraction_static: float = 0.8, context_length: Optional[int] = None, vocab_size: Optional[int] = None,
        seed: Optional[int] = None, startup_timeout_s: float = 600.0, request_timeout_s: float = 600.0,
        probe_timeout_s: float = 2.0, extra_args: Optional[list[str]] = None,
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

    @classmethod
    def from_config(cls, config: "RolloutConfig", replica_index: int) -> "SGLangEngine":
        sg = config.sglang
        return cls(
            model=config.model, base_url=sg.base_url, replica_id=f"sglang-{replica_index}", tp_size=sg.tp_size,
            mem_fraction_static=sg.mem_fraction_static, context_length=config.max_model_len,
            vocab_size=getattr(sg, "vocab_size", None), seed=config.seed, startup_timeout_s=sg.startup_timeout_s,
            request_timeout_s=sg.request_timeout_s, probe_timeout_s=config.health.probe_timeout_s,
            extra_args=sg.extra_args,
        )  # fmt: skip

    # ------------------------------------------------------------------ hooks
    def _ready_route(self) -> str:
        return "/health" if self.base_url is not None else "/health_generate"

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
        params = wire.translate_sampling_params(sampling_params)
        return wire.generate_body(prompt_ids, params, rid=""), params.get("max_new_tokens")

    def _wire_id(self, request_id: str) -> str:
        rid, n = request_id, 1
        while rid in self._table:
            rid = f"{request_id}#{n}"
            n += 1
        return rid

    def _generate_call(self, wire_id: str, body: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        return "/generate", orjson.dumps({**body, "rid": wire_id}), {"Content-Type": "application/json"}

    def _invalid(self, message: str, param: Any, prompt_ids: list[int], body: dict[str, Any]) -> InvalidRequest:
        return wire.invalid_request(message, param)

    def _parse_output(self, raw: bytes, budget: Optional[int]) -> TokenOutput:
        return wire.parse_generate(orjson.loads(raw), budget)

    def _abort_requests(self, wire_ids: list[str], everything: bool) -> list[tuple[str, dict[str, Any]]]:
        return [("/abort_request", body) for body in wire.abort_bodies(wire_ids, everything)]

    async def _pause_server(self) -> bool:
        resp = await self._control("POST", "/pause_generation", op="pause", ok=False, json={"mode": "abort"})
        if resp.status_code == 404:  # servers before pause_generation: abort everything instead
            return False
        self._raise_for(resp, "pause")
        return True

    async def _resume_server(self) -> None:
        resp = await self._control("POST", "/continue_generation", op="resume", ok=False, json={})
        if resp.status_code != 404:
            self._raise_for(resp, "resume")

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
            self._table.release("sleep")
            raise

    async def wake_up(self) -> None:
        resp = await self._control("POST", "/resume_memory_occupation", op="wake_up", ok=False, json={})
        self._raise_unless_memory_saver(resp, "wake_up", "/resume_memory_occupation")
        self._table.release("sleep")

    def _raise_unless_memory_saver(self, resp: Any, op: str, route: str) -> None:
        if resp.status_code in (400, 404):
            message = resp.text.strip()[:500]
            raise NotSupported(
                self.name, op, f"server refused {route} ({message}); launch it with --enable-memory-saver"
            )
        self._raise_for(resp, op)

    async def update_weights(self, weights: Any) -> None:
        if isinstance(weights, (str, os.PathLike)):
            body: dict[str, Any] = {"model_path": os.fspath(weights)}
        elif isinstance(weights, Mapping) and isinstance(weights.get("model_path"), (str, os.PathLike)):
            body = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in weights.items()}
        else:
            raise NotSupported(
                self.name, "update_weights",
                "only checkpoint paths (/update_weights_from_disk) are supported; in-memory state dicts need "
                "/update_weights_from_tensor with MultiprocessingSerializer payloads from a process on the same node",
            )  # fmt: skip
        resp = await self._control("POST", "/update_weights_from_disk", op="update_weights", ok=False, json=body,
                                   timeout=self.request_timeout_s)  # fmt: skip
        try:
            result = resp.json()
        except ValueError:
            result = None
        if resp.status_code == 400 or (isinstance(result, Mapping) and result.get("success") is False):
            message = str(result.get("message")) if isinstance(result, Mapping) else resp.text
            raise InvalidRequest("weights", "a checkpoint the SGLang server can load", body["model_path"], message)
        self._raise_for(resp, "update_weights")

    async def clear_kv_cache(self) -> None:
        # SGLang refuses (400) while requests are running or waiting; retry briefly.
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            resp = await self._control("POST", "/flush_cache", op="clear_kv_cache", ok=False)
            if resp.status_code != 400 or time.monotonic() >= deadline:
                self._raise_for(resp, "clear_kv_cache")
                return
            await asyncio.sleep(0.05)

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
