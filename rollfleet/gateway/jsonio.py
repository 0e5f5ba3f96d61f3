"""JSON encoding for the gateway's hot path: orjson when installed, the standard library otherwise.

Why a module of its own: every response body passes through here, and orjson encodes the small
bodies of RL traffic (a few dozen token ids) several times faster than ``json``. It is optional so
that the gateway runs on a bare install; the output is the same JSON either way (compact, UTF-8).
"""

from __future__ import annotations

import json
from typing import Any, Callable

try:  # pragma: no cover - depends on the environment
    import orjson

    def dumps(obj: Any) -> bytes:
        """Compact UTF-8 JSON; values orjson cannot encode fall back to ``str``."""
        return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS)

    loads: Callable[[Any], Any] = orjson.loads
    BACKEND = "orjson"
except ImportError:  # pragma: no cover - depends on the environment
    _encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)

    def dumps(obj: Any) -> bytes:
        """Compact UTF-8 JSON; values json cannot encode fall back to ``str``."""
        return _encoder.encode(obj).encode()

    loads = json.loads
    BACKEND = "json"


__all__ = ["dumps", "loads", "BACKEND"]
