"""Training checkpoints that a crash can never leave half-written.

Layout under a checkpoint root::

    root/
      latest                  # text: name of the newest complete checkpoint ("step_00000042")
      step_00000041/
      step_00000042/
        model.safetensors     # weights under their Hugging Face names (loadable by vLLM/transformers)
        optimizer.pt          # torch.save(optimizer.state_dict())
        trainer_state.json    # the caller's dict: data position, in-flight prompt ids, RNG states...
        meta.json             # step and format version; written last
        (extra files, e.g. config.json + tokenizer, so the folder is also a model folder)

A checkpoint is written into ``root/.tmp-...`` and renamed into place (atomic on one filesystem),
then ``latest`` is replaced atomically; a crash at any moment leaves either the old or the new
checkpoint, never a torn one. ``find_latest`` trusts ``latest`` but falls back to the highest
complete ``step_*`` folder, so a crash between the rename and the pointer update loses nothing.
Only the last ``keep_last`` checkpoints are kept (never deleting the one ``latest`` names).

A root holds one run's checkpoints: a fresh run (``trainer.resume: false``) in a folder an earlier
run checkpointed into first moves that run's root aside (:func:`set_aside`). Mixed, the fresh
run's pruning deleted its own checkpoints (the older run's had higher steps) and a later resume
loaded the older run's weights.

Trade-off: one writer per root is assumed (the trainer's rank 0); two concurrent writers of the
same step would race on the rename.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

if TYPE_CHECKING:  # imported where a checkpoint is written or read: naming one needs no torch
    import torch

FORMAT_VERSION = 1
CHECKPOINT_PREFIX = "step_"
LATEST_FILE = "latest"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"
META_FILE = "meta.json"


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` returns."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: Optional[dict[str, Any]] = None
    trainer_state: dict[str, Any] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    """Folder name of step ``step`` (zero-padded so names sort like steps)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def _step_of(path: Path) -> Optional[int]:
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    try:
        return int(name[len(CHECKPOINT_PREFIX) :])
    except ValueError:
        return None


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root`` (``meta.json`` present), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_latest(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or ``None``."""
    root = Path(root)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / META_FILE).is_file():
            newer = [p for p in list_checkpoints(root) if (_step_of(p) or 0) > (_step_of(target) or 0)]
            return newer[-1] if newer else target
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it is a complete checkpoint, else the latest one under it (a root);
    :class:`FileNotFoundError` when there is none."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    latest = find_latest(path)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint at or under '{path}'")
    return latest


def aside_of(root: str | os.PathLike) -> Path:
    """Where :func:`set_aside` moves ``root``."""
    root = Path(root)
    return root.with_name(root.name + ".previous")


def set_aside(root: str | os.PathLike) -> Optional[Path]:
    """Move an earlier run's checkpoint root out of a fresh run's way, to ``<root>.previous``;
    return where it went, or None when ``root`` holds no checkpoint. One run back is kept (the
    earlier run may be the one its owner meant to resume); the run set aside before it is deleted.
    ``root`` is the driver's view, where a resume looks for checkpoints too."""
    root = Path(root)
    if not list_checkpoints(root) and not (root / LATEST_FILE).is_file():
        return None
    previous = aside_of(root)
    if previous.exists():
        shutil.rmtree(previous)
    os.replace(root, previous)
    return previous


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


DEFAULT_KEEP_LAST = 3


def commit_checkpoint(
    root: str | os.PathLike, step: int, fill: Callable[[Path], None], keep_last: Optional[int] = DEFAULT_KEEP_LAST
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically, whatever it holds: ``fill(tmp_dir)``
    writes its files (``meta.json`` last) into a fresh folder that then replaces any earlier one of
    that step, ``latest`` points at it, and older ones beyond ``keep_last`` go (``None`` keeps
    all). Returns the checkpoint folder."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=str(root)))
    try:
        fill(tmp)
        for p in tmp.iterdir():
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if target.exists():  # re-saving a step: move the old one aside first (rename needs a free name)
            trash = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=str(root)))
            os.replace(target, trash / target.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_text_atomic(root / LATEST_FILE, target.name + "\n")
    if keep_last is not None:
        for old in list_checkpoints(root)[:-keep_last]:
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor],
    *,
    optimizer_state: Optional[dict[str, Any]] = None,
    trainer_state: Optional[dict[str, Any]] = None,
    keep_last: Optional[int] = DEFAULT_KEEP_LAST,
    write_extra: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically, point ``latest`` at it, prune to
    ``keep_last`` (``None`` keeps all). ``trainer_state`` must be JSON-serialisable (checked before
    anything is written). ``write_extra(tmp_dir)`` may add files. Returns the checkpoint folder."""
    import torch

    state_json = json.dumps(trainer_state or {}, indent=2, sort_keys=True)  # fails early if not JSON
    from safetensors.torch import save_file

    def fill(folder: Path) -> None:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
        if optimizer_state is not None:
            torch.save(optimizer_state, folder / OPTIMIZER_FILE)
        (folder / TRAINER_STATE_FILE).write_text(state_json + "\n")
        if write_extra is not None:
            write_extra(folder)
        meta = {"format_version": FORMAT_VERSION, "step": step, "has_optimizer": optimizer_state is not None}
        (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    return commit_checkpoint(root, step, fill, keep_last)


def load_checkpoint(
    path: str | os.PathLike, *, map_location: str | torch.device = "cpu", load_optimizer: bool = True
) -> Checkpoint:
    """Load a checkpoint folder, or the latest one when ``path`` is a checkpoint root."""
    import torch
    from safetensors.torch import load_file

    path = resolve_checkpoint(path)
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint '{path}' has format {meta.get('format_version')}, expected {FORMAT_VERSION}")
    optimizer_state = None
    if load_optimizer and (path / OPTIMIZER_FILE).is_file():
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location=map_location, weights_only=True)
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        model_state=load_file(str(path / MODEL_FILE), device=str(map_location)),
        optimizer_state=optimizer_state,
        trainer_state=json.loads((path / TRAINER_STATE_FILE).read_text()),
    )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states as a JSON-serialisable dict, for
    ``trainer_state`` (so a resumed run samples the same prompts and shuffles the same way)."""
    import torch

    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the global RandomState is an MT19937: its legacy state is a tuple
    name, keys, pos, has_gauss, cached = np_state
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    import torch

    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "checkpoint_name",
    "list_checkpoints",
    "find_latest",
    "resolve_checkpoint",
    "aside_of",
    "set_aside",
    "DEFAULT_KEEP_LAST",
    "commit_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
]
