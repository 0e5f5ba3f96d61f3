"""The vocabulary size of a model, from its ``config.json``.

Neither server reports it (vLLM's ``/v1/models`` gives the context length only, SGLang's info
routes neither), and the replica needs it to reject out-of-vocabulary prompt ids before they reach
the engine. Multimodal and wrapper configs keep it in a sub-section (``text_config``,
``llm_config``). Only files already on disk are read: a local folder, else the Hugging Face cache
(never the network).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Optional


def read_vocab_size(model_path: Optional[str]) -> Optional[int]:
    """``vocab_size`` from a model's config.json (local folder, else the HF cache), or None."""
    if not model_path:
        return None
    candidates: list[Path] = []
    local = Path(model_path).expanduser()
    if local.is_dir():
        candidates.append(local / "config.json")
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_path, "config.json")
            if isinstance(cached, str):
                candidates.append(Path(cached))
        except Exception:
            pass
    for path in candidates:
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for section in (cfg, cfg.get("text_config") or {}, cfg.get("llm_config") or {}):
            if (
                isinstance(section, Mapping)
                and isinstance(section.get("vocab_size"), int)
                and section["vocab_size"] > 0
            ):
                return int(section["vocab_size"])
    return None


__all__ = ["read_vocab_size"]
