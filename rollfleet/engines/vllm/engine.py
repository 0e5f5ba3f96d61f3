"""VLLMEngine: one vLLM OpenAI server, launched and supervised by the replica (or attached to).

The server is driven over HTTP (see :mod:`rollfleet.engines.http` for why a subprocess and how it
is supervised); this module holds only what is vLLM's own: its hooks into
:class:`~rollfleet.engines.http.HTTPEngine` and the ops whose routes are vLLM's:

* ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  reloads the safetensors files of DIR in place (a partial set of tensors is fine), answering
  ``{"results": [null]}``; an in-memory state dict is written to a temporary folder first;
* ``/reset_prefix_cache`` after a weight update (cached KV was computed with the old weights);
* ``/start_profile`` exists only when the server was launched with ``--profiler-config``
  (:mod:`.launch` adds one writing into the engine's work dir, which shutdown then keeps);
* on the CPU build ``/sleep`` answers 200 but frees nothing: ``sleep`` raises ``NotSupported``.

``base_url`` attaches to a vLLM server someone else runs (started with ``VLLM_SERVER_DEV_MODE=1``);
give ``vocab_size`` then unless ``model`` resolves to a local folder with a ``config.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

import orjson

from rollfleet.engines.base import EngineLimits, EngineLoad
from rollfleet.engines.http import HTTPEngine, ServerStartupError, parse_metrics, read_vocab_size
from rollfleet.engines.vllm import wire
from rollfleet.engines.vllm.launch import VLLMLaunch
from rollfleet.errors import InvalidRequest, NotSupported, ReplicaUnavailable
from rollfleet.types import SamplingParams, TokenOutput

#: Weight loads, sleep and profile traces take longer than a control call.
SLOW_CONTROL_S = 300.0


class VLLMStartupError(ServerStartupError):
    """The vLLM server did not come up (exited or timed out); the message holds its log tail."""


class VLLMEngine(VLLMLaunch, HTTPEngine):
    """One vLLM OpenAI server, driven over HTTP (see the module docstring).

    It listens on :attr:`bind_host` only (the node's IP on a cluster, loopback on an embedded one)
    and sees exactly :attr:`devices` when placement assigned some (``CUDA_VISIBLE_DEVICES``); the
    CPU build keeps its per-replica thread binding.
    """

    name = "vllm"
    server_name = "vLLM server"
    startup_error = VLLMStartupError
    stats_metrics = wire.STATS_METRICS

    def __init__(
        self,
        model: str,
        *,
        max_model_len: int,
        replica_index: int = 0,
        num_replicas: int = 1,
        seed: int = 0,
        dtype: str = "auto",
        enforce_eager: bool = True,
        kv_cache_space_gib: int = 1,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        omp_threads_bind: Optional[str] = None,
        startup_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        extra_args: Optional[list[str]] = None,
        extra_env: Optional[Mapping[str, str]] = None,
        control_timeout_s: float = 60.0,
        health_timeout_s: float = 3.0,
        device: Optional[str] = None,
        base_url: Optional[str] = None,
        vocab_size: Optional[int] = None,
    ) -> None:
        super().__init__(
            label=f"vllm-{replica_index}", base_url=base_url, startup_timeout_s=startup_timeout_s,
            request_timeout_s=request_timeout_s, control_timeout_s=control_timeout_s,
            health_timeout_s=health_timeout_s,
        )  # fmt: skip
        self.model = model
        self.max_model_len = int(max_model_len)
        self.replica_index = replica_index
        self.num_replicas = num_replicas
        self.seed = seed
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.kv_cache_space_gib = kv_cache_space_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.omp_threads_bind = omp_threads_bind
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(extra_env or {})
        self.vocab_size = vocab_size
        self._device = device  # "cpu" | "cuda" | None (detect at start)
        self.model_path: Optional[str] = None
        self._vocab = 0  # known once start() has resolved the model
        self._seq = itertools.count()

    @classmethod
    def from_config(cls, config: Any, replica_index: int) -> "VLLMEngine":
        """Build (not start) the engine of replica ``replica_index`` from a ``RolloutConfig``."""
        v = config.vllm
        return cls(
            config.model,
            max_model_len=config.max_model_len,
            replica_index=replica_index,
            num_replicas=max(1, config.num_replicas),
            seed=config.seed,
            dtype=v.dtype,
            enforce_eager=v.enforce_eager,
            kv_cache_space_gib=v.kv_cache_space_gib,
            gpu_memory_utilization=v.gpu_memory_utilization,
            tensor_parallel_size=v.tensor_parallel_size,
            max_num_seqs=v.max_num_seqs,
            enable_prefix_caching=v.enable_prefix_caching,
            omp_threads_bind=v.omp_threads_bind,
            startup_timeout_s=v.startup_timeout_s,
            request_timeout_s=v.request_timeout_s,
            extra_args=v.extra_args,
            extra_env=v.extra_env,
        )

    @property
    def profile_dir(self) -> Optional[Path]:
        return self.workdir / "profiles" if self.workdir is not None else None

    # ------------------------------------------------------------------ hooks
    async def _prepare(self) -> None:
        if self.base_url is None or self.vocab_size is None:
            from rollfleet.models import get_model_path

            self.model_path = await asyncio.to_thread(get_model_path, self.model)
        vocab = self.vocab_size or read_vocab_size(self.model_path)
        if not vocab:  # before launching: a model without it is refused at once
            raise ValueError(f"no vocab_size in {self.model_path}/config.json")
        self._vocab = int(vocab)

    async def _discover_limits(self) -> EngineLimits:
        return EngineLimits(vocab_size=self._vocab, max_model_len=self.max_model_len)

    def _build_request(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       extras: dict[str, Any]) -> tuple[dict[str, Any], Optional[int]]:  # fmt: skip
        """``extras``: ``priority`` is passed to vLLM (it matters with ``--scheduling-policy
        priority``); other per-request extras (multimodal data) are not supported by this
        text-only adapter."""
        body, max_tokens = wire.completion_body(self.model, prompt_ids, sampling_params, self.max_model_len)
        if "priority" in extras:
            body["priority"] = int(extras.pop("priority"))
        if extras:
            raise InvalidRequest(next(iter(extras)), "not supported by the vllm engine adapter (text only)", "...")
        return body, max_tokens

    def _wire_id(self, request_id: str) -> str:
        return f"{wire.header_safe(request_id)}~{next(self._seq)}"

    def _generate_call(self, wire_id: str, body: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        return "/v1/completions", orjson.dumps(body), {"X-Request-Id": wire_id, "Content-Type": "application/json"}

    def _invalid(self, message: str, param: Any, prompt_ids: list[int], body: dict[str, Any]) -> InvalidRequest:
        return wire.invalid_request(message, param, prompt_ids, body)

    def _parse_output(self, raw: bytes, budget: Optional[int]) -> TokenOutput:
        return wire.parse_completion(raw, budget)

    def _abort_requests(self, wire_ids: list[str], everything: bool) -> list[tuple[str, dict[str, Any]]]:
        return [("/abort_requests", wire.abort_body(wire_ids))]  # our ids only, even for "everything"

    async def _pause_server(self) -> bool:
        await self._control("POST", "/pause", op="pause", params={"mode": "abort", "clear_cache": "false"})
        return True

    async def _resume_server(self) -> None:
        await self._control("POST", "/resume", op="resume")

    async def _server_load(self) -> EngineLoad:
        """running / waiting / KV usage from vLLM's ``/metrics`` (in-flight tokens: our own count)."""
        resp = await self._control("GET", "/metrics", op="load", timeout=self.health_timeout_s)
        metrics = self._last_metrics = parse_metrics(resp.text, wire.LOAD_METRICS)
        return EngineLoad(
            running=int(metrics.get(wire.METRIC_RUNNING, 0)),
            waiting=int(metrics.get(wire.METRIC_WAITING, 0)),
            kv_usage=float(metrics.get(wire.METRIC_KV, 0.0)),
        )

    def _inflight_tokens(self, server_load: EngineLoad) -> int:
        """Prompt + token budget of each request this engine has not had answered yet."""
        return self._table.tokens()

    def _keep_workdir(self, workdir: Path) -> bool:
        profiles = workdir / "profiles"
        return profiles.exists() and any(profiles.iterdir())  # traces nobody collected

    # ------------------------------------------------------------------ vLLM's own ops
    async def sleep(self) -> None:
        if self.device == "cpu":
            raise NotSupported("vllm", "sleep", "the CPU build cannot free memory")
        await self._control(
            "POST", "/sleep", op="sleep", params={"level": 1}, timeout=max(self.control_timeout_s, SLOW_CONTROL_S)
        )

    async def wake_up(self) -> None:
        if self.device == "cpu":
            raise NotSupported("vllm", "wake_up", "the CPU build cannot free memory, so there is nothing to re-acquire")
        await self._control("POST", "/wake_up", op="wake_up", timeout=max(self.control_timeout_s, SLOW_CONTROL_S))

    async def clear_kv_cache(self) -> None:
        await self._control("POST", "/reset_prefix_cache", op="clear_kv_cache")

    async def update_weights(self, weights: Any) -> None:
        """Load new weights: a state dict (name -> tensor, or an iterable of pairs), a
        ``.safetensors`` file, or a folder of ``*.safetensors``. Names are those of the Hugging
        Face checkpoint (``model.layers.0.self_attn.q_proj.weight``...); a subset is fine."""
        self._check_alive()
        tmp: Optional[str] = None
        try:
            if isinstance(weights, (str, os.PathLike)):
                path = Path(weights)
                # Two stat calls on a local path: not worth a thread hop.
                if path.is_dir():  # noqa: ASYNC240
                    weights_dir = str(path)
                elif path.is_file() and path.suffix == ".safetensors":  # noqa: ASYNC240
                    tmp = tempfile.mkdtemp(prefix="rollfleet-weights-")
                    os.symlink(path.resolve(), Path(tmp) / "model.safetensors")  # noqa: ASYNC240
                    weights_dir = tmp
                else:
                    raise ValueError(f"update_weights: {path} is neither a folder nor a .safetensors file")
            else:
                items = weights.items() if isinstance(weights, Mapping) else weights
                tmp = tempfile.mkdtemp(prefix="rollfleet-weights-")
                await asyncio.to_thread(_save_state_dict, dict(items), Path(tmp) / "model.safetensors")
                weights_dir = tmp
            await self._control(
                "POST", "/collective_rpc", op="update_weights",
                json={"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                timeout=max(self.control_timeout_s, 2 * SLOW_CONTROL_S),
            )  # fmt: skip
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # Cached KV was computed with the old weights. Best effort: a busy engine may refuse.
        try:
            await self._control("POST", "/reset_prefix_cache", op="clear_kv_cache", ok=False)
        except ReplicaUnavailable:
            pass

    async def start_profile(self, **kwargs: Any) -> None:
        body = {k: v for k, v in kwargs.items() if k in ("profile_prefix", "delay_iterations", "max_iterations")}
        resp = await self._control("POST", "/start_profile", op="start_profile", ok=False, json=body or None,
                                   timeout=max(self.control_timeout_s, 120))  # fmt: skip
        self._raise_unless_profiling(resp, "start_profile")

    async def stop_profile(self) -> Optional[str]:
        resp = await self._control("POST", "/stop_profile", op="stop_profile", ok=False,
                                   timeout=max(self.control_timeout_s, SLOW_CONTROL_S))  # fmt: skip
        self._raise_unless_profiling(resp, "stop_profile")
        return str(self.profile_dir) if self.profile_dir is not None else None

    def _raise_unless_profiling(self, resp: Any, op: str) -> None:
        if resp.status_code == 404:
            raise NotSupported("vllm", op, "the server was launched without --profiler-config")
        self._raise_for(resp, op)


def _save_state_dict(state: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    seen: set[int] = set()
    for name, t in state.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        if t.data_ptr() in seen:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


__all__ = ["VLLMEngine", "VLLMStartupError"]
