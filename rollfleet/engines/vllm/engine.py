"""VLLMEngine: one vLLM OpenAI server, launched and supervised by the replica (or attached to).

The server is driven over HTTP (see :mod:`rollfleet.engines.http` for why a subprocess and how it
is supervised); this module holds only what is vLLM's own: its hooks into
:class:`~rollfleet.engines.http.HTTPEngine` and the ops whose routes are vLLM's. A server rollfleet
launches gets vLLM 0.32's RL API (``--enable-scale-out``, ``--weight-transfer-config`` with
rollfleet's ``rollfleet_tmpfs`` backend, see :mod:`.launch`), and the engine uses it:

* generation goes through ``POST /inference/v1/generate`` (token ids in and out): it is the one
  route whose answer says which weights sampled each token (``weight_versions`` spans, turned into
  ``TokenOutput.token_versions``), which a request kept across an update needs. Every request
  carries ``cache_salt`` = the server's current weight label, so that after an update that kept the
  KV cache no new request reuses prefix blocks the old weights computed (vLLM salts block hashes);
  requests within one version still share their prefixes;
* two-phase weight updates (``update_modes``: ``abort`` and ``keep``): staged to a node-local tmpfs
  file while the engine generates, committed through ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, in ``keep`` mode between ``/pause?mode=keep`` and
  ``/resume`` so that the requests in flight continue on the new weights; a keep commit is one
  ``POST /rollfleet/commit`` making those calls inside the server (:mod:`rollfleet.vllm_plugin.commit`,
  installed with ``--middleware``), the routes one by one where a server lacks it (:mod:`.weights`);
* ``POST /collective_rpc`` ``reload_weights`` for one-phase updates (:meth:`update_weights`) and
  for servers without the RL routes (:mod:`.weights`);
* ``/reset_prefix_cache`` after an update in ``abort`` mode (cached KV was computed with the old weights);
* ``/start_profile`` exists only when the server was launched with ``--profiler-config``
  (:mod:`.launch` adds one writing into the engine's work dir, which shutdown then keeps);
* on the CPU build ``/sleep`` answers 200 but frees nothing: ``sleep`` raises ``NotSupported``.

``base_url`` attaches to a vLLM server someone else runs (started with ``VLLM_SERVER_DEV_MODE=1``);
give ``vocab_size`` then unless ``model`` resolves to a local folder with a ``config.json``. Such a
server may lack the RL flags, so by default the engine keeps to what every dev-mode server has:
``/v1/completions`` for generation (no per-token versions) and ``reload_weights`` for updates
(``abort`` only). ``rl_routes=True`` says the server was launched as rollfleet launches it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

import orjson

from rollfleet.engines.base import EngineLimits, EngineLoad, replica_seed
from rollfleet.engines.http import HTTPEngine, ServerStartupError, parse_metrics, read_vocab_size
from rollfleet.engines.http.inflight import DRAIN_TIMEOUT_S
from rollfleet.engines.http.streaming import StreamingGenerate, StreamReader
from rollfleet.engines.vllm import wire
from rollfleet.engines.vllm.launch import VLLMLaunch
from rollfleet.engines.vllm.staging import Staged, StageDir, default_root
from rollfleet.engines.vllm.weights import SLOW_CONTROL_S, VLLMWeights
from rollfleet.errors import InvalidRequest, NotSupported, ReplicaUnavailable
from rollfleet.types import SamplingParams, TokenOutput

logger = logging.getLogger(__name__)


class VLLMStartupError(ServerStartupError):
    """The vLLM server did not come up (exited or timed out); the message holds its log tail."""


#: The options vLLM's own ``/start_profile`` takes (it ignores any other).
SERVER_PROFILE_OPTIONS = frozenset({"profile_prefix", "delay_iterations", "max_iterations"})


class VLLMEngine(VLLMLaunch, VLLMWeights, StreamingGenerate, HTTPEngine):
    """One vLLM OpenAI server, driven over HTTP (see the module docstring).

    ``listen``: ``"unix"`` (a private socket; its ``/metrics`` and ``/health`` on :attr:`bind_host`
    through an exporter) or ``"tcp"`` (on :attr:`bind_host`: the node's IP on a cluster, loopback
    on an embedded one; never every interface). It sees exactly :attr:`devices` when placement
    assigned some (``CUDA_VISIBLE_DEVICES``); the CPU build keeps its per-replica thread binding.

    ``stage_dir``/``stage_key``: where :meth:`stage_weights` writes (``<stage_dir>/<stage_key>/``;
    by default ``/dev/shm/rollfleet-weights`` and a key of this engine's own). Replicas of one
    fleet on one node that share a key write each version once. ``rl_routes``: whether the server
    has the RL routes (default: when rollfleet launches it; see the module docstring).
    """

    name = "vllm"
    streams = True  # with its RL routes (a server rollfleet launched); whole answers otherwise
    server_name = "vLLM server"
    #: vLLM's StartProfileRequest, and ``trace_dir`` (the sim and SGLang engines' name): where
    #: stop_profile moves the traces from the directory the server was launched with.
    profile_options = SERVER_PROFILE_OPTIONS | {"trace_dir"}
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
        rl_routes: Optional[bool] = None,
        stage_dir: Optional[str] = None,
        stage_key: Optional[str] = None,
        listen: str = "unix",
    ) -> None:
        if listen not in ("unix", "tcp"):
            raise ValueError(f"listen must be 'unix' or 'tcp', got {listen!r}")
        super().__init__(
            label=f"vllm-{replica_index}", base_url=base_url, startup_timeout_s=startup_timeout_s,
            request_timeout_s=request_timeout_s, control_timeout_s=control_timeout_s,
            health_timeout_s=health_timeout_s, private=listen == "unix",
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
        self.rl_routes = (base_url is None) if rl_routes is None else bool(rl_routes)
        self.stage = StageDir(stage_dir or default_root(), stage_key or f"engine-{uuid.uuid4().hex[:12]}")
        self._staged: dict[int, Staged] = {}
        #: The server's weight label (vLLM's ``weight_version``): the cache salt of new requests.
        self._label = wire.BOOT_VERSION
        self._trace_dir: Optional[str] = None  # where stop_profile moves this session's traces
        self._reloads = itertools.count(1)
        self._weights_lock = asyncio.Lock()  # one load at a time, and no resume during one
        #: What the last stage and commit took (seconds, bytes, pause window), for operators and tests.
        self.last_stage: dict[str, Any] = {}
        self.last_commit: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: Any, replica_index: int) -> "VLLMEngine":
        """Build (not start) the engine of replica ``replica_index`` from a ``RolloutConfig``."""
        v = config.vllm
        return cls(
            config.model,
            max_model_len=config.max_model_len,
            replica_index=replica_index,
            num_replicas=max(1, config.num_replicas),
            seed=replica_seed(config.seed, replica_index),
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
            stage_dir=config.weight_sync.stage_dir,
            stage_key=config.weight_sync.stage_key,
            listen=v.listen,
        )

    @property
    def update_modes(self) -> frozenset[str]:  # type: ignore[override]  # a class constant elsewhere; here it depends on the server
        """``abort`` and ``keep`` with the RL routes; ``abort`` (``reload_weights``) without."""
        return frozenset({"abort", "keep"}) if self.rl_routes else frozenset({"abort"})

    @property
    def weight_label(self) -> str:
        """The server's weight label: ``"default"`` until the first commit, then its version."""
        return self._label

    @property
    def profile_dir(self) -> Optional[Path]:
        return self.workdir / "profiles" if self.workdir is not None else None

    # ------------------------------------------------------------------ hooks
    async def _prepare(self) -> None:
        self._label = wire.BOOT_VERSION  # a (re)started server has the weights it boots with
        if self.base_url is None or self.vocab_size is None:
            from rollfleet.models import get_model_path

            self.model_path = await asyncio.to_thread(get_model_path, self.model)
        vocab = self.vocab_size or read_vocab_size(self.model_path)
        if not vocab:  # before launching: a model without it is refused at once
            raise ValueError(f"no vocab_size in {self.model_path}/config.json")
        self._vocab = int(vocab)

    async def _discover_limits(self) -> EngineLimits:
        if self.rl_routes and self.base_url is not None:  # attached: the server may have been updated
            resp = await self._request("GET", "/weight_info", op="start")
            self._raise_for(resp, "start")
            self._label = str(resp.json().get("weight_version") or wire.BOOT_VERSION)
        return EngineLimits(vocab_size=self._vocab, max_model_len=self.max_model_len)

    def _build_request(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       extras: dict[str, Any]) -> tuple[dict[str, Any], Optional[int]]:  # fmt: skip
        """``extras``: ``priority`` is passed to vLLM (it matters with ``--scheduling-policy
        priority``); other per-request extras (multimodal data) are not supported by this
        text-only adapter."""
        if self.rl_routes:
            body, max_tokens = wire.generate_body(prompt_ids, sampling_params, self.max_model_len)
        else:
            body, max_tokens = wire.completion_body(self.model, prompt_ids, sampling_params, self.max_model_len)
        if "priority" in extras:
            body["priority"] = int(extras.pop("priority"))
        if extras:
            raise InvalidRequest(next(iter(extras)), "not supported by the vllm engine adapter (text only)", "...")
        return body, max_tokens

    def _wire_id(self, request_id: str) -> str:
        return f"{wire.header_safe(request_id)}~{next(self._seq)}"

    def _generate_call(self, wire_id: str, body: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        headers = {"X-Request-Id": wire_id, "Content-Type": "application/json"}
        if self.rl_routes:
            # Salted when it goes out (past the gate), with the label of the weights it will run on.
            return wire.GENERATE_ROUTE, orjson.dumps(wire.salted(body, self._label)), headers
        return "/v1/completions", orjson.dumps(body), headers

    def _invalid(self, message: str, param: Any, prompt_ids: list[int], body: dict[str, Any]) -> InvalidRequest:
        return wire.invalid_request(message, param, prompt_ids, body)

    def _stream_reader(self) -> Optional[StreamReader]:
        return wire.GenerateStream() if self.rl_routes else None  # /v1/completions: whole answers

    def _parse_output(self, raw: bytes, budget: Optional[int]) -> TokenOutput:
        if self.rl_routes:
            return wire.parse_generate(raw, budget)
        return wire.parse_completion(raw, budget)

    def _abort_requests(self, wire_ids: list[str], everything: bool) -> list[tuple[str, dict[str, Any]]]:
        return [("/abort_requests", wire.abort_body(wire_ids, self.rl_routes))]  # our ids only, even for "everything"

    async def _pause_server(self) -> bool:
        async with self._weights_lock:  # a keep commit in progress finishes first
            await self._control("POST", "/pause", op="pause", params={"mode": "abort", "clear_cache": "false"})
        return True

    async def _resume_server(self) -> None:
        async with self._weights_lock:  # never between /start_weight_update and /finish_weight_update
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

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the server (see :meth:`HTTPEngine.shutdown`) and release this engine's staged files."""
        await super().shutdown(grace_s)
        self._staged.clear()
        await asyncio.to_thread(self.stage.release_all)

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
        """vLLM answers 200 ``{"success": false}`` while blocks are still held (running requests,
        KV offload in flight): tried again for up to ``DRAIN_TIMEOUT_S``. Then a server whose
        requests are not salted with the weights' label (attached, no RL routes) would go on
        hitting KV the old weights computed: unavailable (fenced, restarted). Salted, its
        requests never reach that KV, and the stale blocks are only evicted later."""
        deadline = asyncio.get_running_loop().time() + DRAIN_TIMEOUT_S
        while not _reset_done(await self._control("POST", "/reset_prefix_cache", op="clear_kv_cache")):
            if asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
                continue
            if not self.rl_routes:
                raise ReplicaUnavailable(
                    self.replica_label, f"clear_kv_cache: vLLM kept its prefix cache for {DRAIN_TIMEOUT_S:g}s"
                )
            logger.warning("%s: vLLM kept its prefix cache (blocks still held)", self.replica_label)
            return

    # ------------------------------------------------------------------ profiling
    async def start_profile(self, **kwargs: Any) -> None:
        body = {k: v for k, v in kwargs.items() if k in SERVER_PROFILE_OPTIONS}
        resp = await self._control("POST", "/start_profile", op="start_profile", ok=False, json=body or None,
                                   timeout=max(self.control_timeout_s, 120))  # fmt: skip
        self._raise_unless_profiling(resp, "start_profile")
        self._trace_dir = kwargs.get("trace_dir")

    async def stop_profile(self) -> Optional[str]:
        """Where the traces are: the launch's profile dir, or the ``trace_dir`` given to
        :meth:`start_profile` (on this replica's node), into which they were moved."""
        resp = await self._control("POST", "/stop_profile", op="stop_profile", ok=False,
                                   timeout=max(self.control_timeout_s, SLOW_CONTROL_S))  # fmt: skip
        self._raise_unless_profiling(resp, "stop_profile")
        source, target = self.profile_dir, self._trace_dir
        self._trace_dir = None
        if source is None:
            return None
        if target is None:
            return str(source)
        await asyncio.to_thread(_move_traces, source, Path(target))
        return str(target)

    def _raise_unless_profiling(self, resp: Any, op: str) -> None:
        if resp.status_code == 404:
            raise NotSupported("vllm", op, "the server was launched without --profiler-config")
        self._raise_for(resp, op)


def _move_traces(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for trace in source.iterdir() if source.is_dir() else ():
        shutil.move(str(trace), str(target / trace.name))


def _reset_done(resp: Any) -> bool:
    """Whether ``/reset_prefix_cache`` reset it (a vLLM that says nothing did)."""
    try:
        body = resp.json()
    except ValueError:
        return True
    return not isinstance(body, dict) or body.get("success", True) is not False


__all__ = ["VLLMEngine", "VLLMStartupError"]
