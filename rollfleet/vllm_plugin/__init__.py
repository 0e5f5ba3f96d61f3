"""rollfleet's vLLM plugin: the ``rollfleet_tmpfs`` weight-transfer backend.

Why a plugin: vLLM 0.32's two-phase weight update (``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) runs through a weight-transfer backend chosen at launch
(``--weight-transfer-config '{"backend": ...}'``), and none of the built-in ones works without a
GPU (``nccl`` needs an accelerator, ``ipc`` CUDA; see ``docs/vllm-rl-api-on-cpu.md``). This backend
reads a safetensors file from a node-local path (tmpfs: ``/dev/shm``) that the replica staged
while the engine kept generating, so it works on the CPU build and, as a fallback, on GPUs.

vLLM finds it through the ``vllm.general_plugins`` entry point (``rollfleet =
"rollfleet.vllm_plugin:register"`` in ``pyproject.toml``) and calls :func:`register` in every one
of its processes (API server, engine core, workers). This module therefore imports nothing
heavy: the engine class lives in :mod:`rollfleet.vllm_plugin.tmpfs` and vLLM's factory imports it
lazily, only in the worker that creates the engine. (``rollfleet/__init__.py``, the one other
module an import of this one runs, holds only a version string.)
"""

from __future__ import annotations

#: The backend's name in ``--weight-transfer-config``.
BACKEND = "rollfleet_tmpfs"
#: Where vLLM's factory finds the engine class (imported on first use).
ENGINE_MODULE = "rollfleet.vllm_plugin.tmpfs"
ENGINE_CLASS = "TmpfsWeightTransferEngine"


def register() -> None:
    """Register :data:`BACKEND` in vLLM's weight-transfer factory (idempotent: vLLM may load
    general plugins more than once in one process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)


__all__ = ["BACKEND", "ENGINE_MODULE", "ENGINE_CLASS", "register"]
