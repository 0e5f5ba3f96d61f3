"""Shared by the gateway tests: the model name and a small sim fleet's config."""

from __future__ import annotations

import functools
from typing import Any

from rollfleet.config import RollfleetConfig
from rollfleet.gateway import TextCodec

MODEL = "tiny"


@functools.lru_cache(maxsize=None)
def load_codec() -> TextCodec:
    """The tiny model's tokenizer, loaded once per test session (loading transformers is slow)."""
    return TextCodec.load(MODEL)


def stack_config(time_scale: float = 50.0, **gateway: Any) -> RollfleetConfig:
    """Small, fast sim fleet: 2 replicas, a 512-token context, ~30-token answers at 50x."""
    return RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "sim",
                "model": MODEL,
                "num_replicas": 2,
                "prompt_length": 256,
                "response_length": 64,
                "max_model_len": 512,
                "routing": {"policy": "least_tokens", "load_refresh_interval_s": 0.1},
                "retry": {"max_attempts": 50, "initial_backoff_s": 0.01, "max_backoff_s": 0.2},
                "health": {"probe_interval_s": 0.2, "probe_timeout_s": 1.0, "failures_to_dead": 3},
                "sim": {"time_scale": time_scale, "mean_response_tokens": 30, "response_sigma": 0.5},
            },
            "gateway": {"host": "127.0.0.1", "port": 0, "status_poll_interval_s": 0.2, **gateway},
        }
    )
