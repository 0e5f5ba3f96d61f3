"""Shared by the gateway tests: the model name and a small sim fleet's config."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

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


async def in_process_gateway(
    config: Any, *, response_length: int, time_scale: float, mean_response_tokens: int, **server_options: Any
) -> tuple[Any, Any, Any]:
    """A gateway over one in-process sim replica (no Ray), started on a free loopback port:
    ``(server, gateway, replica)``; the caller stops the server and shuts the replica down."""
    from rollfleet.client import LLMServerClient
    from rollfleet.config import RolloutConfig, SimEngineConfig
    from rollfleet.gateway import Gateway, GatewayServer
    from rollfleet.server.local import LocalHandle
    from rollfleet.server.replica import Replica

    codec = load_codec()
    rollout = RolloutConfig(
        name="sim",
        model=MODEL,
        prompt_length=256,
        response_length=response_length,
        max_model_len=512,
        sim=SimEngineConfig(
            vocab_size=codec.vocab_size, time_scale=time_scale, mean_response_tokens=mean_response_tokens
        ),
    )
    replica = Replica("r0", rollout, 0)
    await replica.start(version=0)
    client = LLMServerClient(rollout, servers={"r0": LocalHandle(replica)})
    gw = Gateway(client, codec, config=config, rollout=rollout)
    return await GatewayServer(gw.app, **server_options).start(), gw, replica


@asynccontextmanager
async def slow_gateway() -> AsyncIterator[tuple[Any, Any, Any]]:
    """:func:`in_process_gateway` whose 300-token answers take about a second (time_scale 5), so
    "early" and "mid-way" are measurable; stopped afterwards."""
    from rollfleet.config import GatewayConfig

    server, gw, replica = await in_process_gateway(
        GatewayConfig(), response_length=300, time_scale=5.0, mean_response_tokens=50
    )
    try:
        yield server, gw, replica
    finally:
        await server.stop()
        await replica.shutdown()
