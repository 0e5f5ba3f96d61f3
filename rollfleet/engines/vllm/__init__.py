"""The vLLM engine: a vLLM OpenAI server subprocess on its node's address, supervised by the replica.

Why a server subprocess (``python -m vllm.entrypoints.openai.api_server``) and not an in-process
``AsyncLLM``: process isolation and a survivable, observable kill (see
:mod:`rollfleet.engines.http.process`); the control routes exist as HTTP routes in dev mode
(``/abort_requests``, ``/pause`` ``/resume``, ``/sleep`` ``/wake_up``, ``/reset_prefix_cache``,
``/collective_rpc``, ``/start_profile`` ``/stop_profile``); and it is the same server that external
OpenAI clients and Prometheus (``/metrics``) talk to, so what rollfleet measures is what everyone
else sees.

Where things are: :mod:`.wire` (request body, response and error parsing, the HTTP facts of vLLM
0.32), :mod:`.launch` (command line, environment, devices, CPU thread binding), :mod:`.engine`
(the engine: hooks into :class:`rollfleet.engines.http.HTTPEngine` and vLLM's own routes).
"""

from rollfleet.engines.http import BUSY_GRACE_S, parse_metrics
from rollfleet.engines.vllm.engine import VLLMEngine, VLLMStartupError
from rollfleet.engines.vllm.launch import omp_threads_bind

__all__ = ["VLLMEngine", "VLLMStartupError", "omp_threads_bind", "parse_metrics", "BUSY_GRACE_S"]
