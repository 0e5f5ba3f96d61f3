"""The ``rollfleet_tmpfs`` weight-transfer engine (runs inside vLLM's worker processes).

``/update_weights`` ``{"update_info": {"path": "/dev/shm/.../v7.safetensors"}}``: the file's
tensors, in Hugging Face checkpoint names, go through ``model.load_weights`` within vLLM's
layerwise-reload lifecycle, exactly like the built-in ``nccl`` and ``ipc`` engines:
``start_weight_update`` moves the layers' parameters to the meta device, each layer is rebuilt
as soon as all its tensors have arrived, ``finish_weight_update`` rebuilds the rest (a layer that
received nothing keeps its tensors). Any forward pass between start and finish would run on meta
tensors and kill the engine: the caller pauses the server first (see
:mod:`rollfleet.engines.vllm.engine`).

The file is opened with safetensors' ``safe_open`` (memory-mapped; on tmpfs it is already in
memory) and read one tensor at a time, so a worker never holds a second copy of the model: each
tensor is copied once, into the layer it belongs to. The file is never written or removed here:
it belongs to whoever staged it (several replicas on one node may load the same file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class TmpfsInitInfo(WeightTransferInitInfo):
    """Nothing to set up: ``/init_weight_transfer_engine`` is not needed (and accepted)."""


@dataclass
class TmpfsUpdateInfo(WeightTransferUpdateInfo):
    #: A ``.safetensors`` file readable by the worker (node-local).
    path: str


def read_safetensors(path: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of a safetensors file, read lazily from its memory map."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


class TmpfsWeightTransferEngine(WeightTransferEngine[TmpfsInitInfo, TmpfsUpdateInfo]):
    init_info_cls = TmpfsInitInfo
    update_info_cls = TmpfsUpdateInfo

    def init_transfer_engine(self, init_info: TmpfsInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: TmpfsUpdateInfo) -> None:
        # CPU tensors on a GPU worker too: the weight loaders copy each into its (device) parameter,
        # as they do when vLLM loads a checkpoint at start-up.
        self.model.load_weights(read_safetensors(update_info.path))

    def shutdown(self) -> None:
        pass


__all__ = ["TmpfsWeightTransferEngine", "TmpfsInitInfo", "TmpfsUpdateInfo", "read_safetensors"]
