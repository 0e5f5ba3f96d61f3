"""The vLLM engine: a vLLM OpenAI server subprocess on its node's address, supervised by the replica.

Why a server subprocess (``python -m vllm.entrypoints.openai.api_server``) and not an in-process
``AsyncLLM``: process isolation and a survivable, observable kill (see
:mod:`rollfleet.engines.http.process`); the control routes exist as HTTP routes in dev mode
(``/abort_requests``, ``/pause`` ``/resume``, ``/sleep`` ``/wake_up``, ``/reset_prefix_cache``,
``/collective_rpc``, ``/start_profile`` ``/stop_profile``); and it is the same server that external
OpenAI clients and Prometheus (``/metrics``) talk to, so what rollfleet measures is what everyone
else sees.

What a launched server is used for beyond plain serving, vLLM 0.32's RL API: generation through
``/inference/v1/generate`` (the one route that says which weights sampled each token) and weight
updates in two phases that barely stop it: staged to a node-local tmpfs file while it generates,
then committed between ``/pause?mode=keep`` and ``/resume`` (``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), the requests in flight frozen with their KV cache
and continued on the new weights. vLLM has no weight-transfer backend that works without a GPU, so
rollfleet brings one, ``rollfleet_tmpfs`` (:mod:`rollfleet.vllm_plugin`, loaded by vLLM through
its ``vllm.general_plugins`` entry point). A server someone else runs (``base_url``) is driven
through ``/v1/completions`` and ``reload_weights`` unless it is declared to have the RL routes.

Where things are: :mod:`.wire` (request bodies, response and error parsing, the HTTP facts of vLLM
0.32), :mod:`.launch` (command line, environment, devices, CPU thread binding), :mod:`.staging`
(the stage files: written once per node, shared by a fleet's replicas, released by the last one),
:mod:`.engine` (the engine: hooks into :class:`rollfleet.engines.http.HTTPEngine` and vLLM's own
routes).
"""

from rollfleet.engines.http import BUSY_GRACE_S, parse_metrics
from rollfleet.engines.vllm.engine import VLLMEngine, VLLMStartupError
from rollfleet.engines.vllm.launch import omp_threads_bind

__all__ = ["VLLMEngine", "VLLMStartupError", "omp_threads_bind", "parse_metrics", "BUSY_GRACE_S"]
