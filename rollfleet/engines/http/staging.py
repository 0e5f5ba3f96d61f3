"""Node-local staging shared by the engines that load weights from files (vLLM, SGLang): where
staged weights go by default, the check of a fleet's stage key, and the streaming safetensors writer.

The writer streams tensor by tensor rather than building the whole serialized file in memory
first, as ``safetensors.torch.save_file`` does: a replica staging a large model holds one
tensor's extra copy at most (a GPU tensor is copied to the host one at a time), not a second model.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollfleet.errors import InvalidRequest

_DTYPES = {  # torch dtype name -> safetensors dtype
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def default_root() -> Path:
    """``/dev/shm/rollfleet-weights`` where there is a ``/dev/shm`` (tmpfs), else the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "rollfleet-weights"


def check_stage_key(key: str) -> str:
    """A stage key names one folder under the stage root: a plain name, nothing that walks out of it."""
    if not key or "/" in key or key in (".", ".."):
        raise ValueError(f"stage_key must be a plain folder name, got {key!r}")
    return key


def tensors_of(weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A state dict (or an iterable of pairs) as a list of pairs, taken once (a retry must not
    write a used-up iterable: an empty file); refused when it holds none (a load of nothing
    succeeds: vLLM and SGLang keep every layer that received no tensor)."""
    items = list(weights.items() if isinstance(weights, Mapping) else weights)
    if not items:
        raise InvalidRequest("weights", "at least one tensor", "an empty state dict")
    return items


def write_safetensors(weights: Mapping[str, Any] | Iterable[tuple[str, Any]], path: Path) -> int:
    """Write a state dict (name -> tensor, or an iterable of pairs) as one safetensors file, a
    tensor at a time; return the bytes written. Tied tensors are simply written twice."""
    import torch

    items = list(weights.items() if isinstance(weights, Mapping) else weights)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        dtype = _DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be written to safetensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            t = t.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return 8 + len(raw) + offset


__all__ = ["check_stage_key", "default_root", "write_safetensors"]
