"""Start a fleet and a gateway in front of it (``rollfleet serve``), and stop both cleanly.

Order matters on the way up and on the way down:

1. load the tokenizer first, and for the ``sim`` engine make the simulated vocabulary *be* the
   tokenizer's (``rollout.sim.vocab_size = len(tokenizer)``, ``eos_token_id`` = its EOS): the sim
   draws token ids from its vocabulary, and ids the tokenizer cannot decode, or a chat-template
   prompt rejected as out of vocabulary, would make the gateway useless.
   ``rollfleet.models.vocab.fit_sim_to_model`` does the same from the model's ``config.json``
   (for ``rollfleet train``); the gateway uses the tokenizer it really decodes with, because a
   model's embedding table is often padded past ``len(tokenizer)`` and such ids decode to nothing.
2. launch the fleet (Ray, controller, replicas), take a ``FullyAsyncLLMServerClient`` from it;
3. start the HTTP server, then write the Prometheus scrape config (it needs the gateway's port).

Down: stop the HTTP server (in-flight requests finish, bounded), then the fleet, then Ray if the
manager started it. Ctrl-C and SIGTERM both take that path.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable, Optional

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.gateway.app import Gateway
from rollfleet.gateway.codec import TextCodec
from rollfleet.gateway.prometheus import PrometheusConfig, update_prometheus_config
from rollfleet.gateway.server import GatewayServer, check_can_listen

logger = logging.getLogger(__name__)


def fit_sim_to_tokenizer(config: RollfleetConfig, codec: TextCodec) -> RollfleetConfig:
    """A copy of ``config`` whose sim engine draws ids from the tokenizer's vocabulary."""
    rollout = config.rollout
    if rollout.name != "sim":
        return config
    update: dict[str, Any] = {"vocab_size": codec.vocab_size}
    if codec.eos_token_id is not None:
        update["eos_token_id"] = codec.eos_token_id
    sim = rollout.sim.model_copy(update=update)
    return config.model_copy(update={"rollout": rollout.model_copy(update={"sim": sim})})


class GatewayStack:
    """A fleet (manager + client) and the gateway serving it."""

    def __init__(self, config: RollfleetConfig, manager: Any, gateway: Gateway, server: GatewayServer) -> None:
        self.config = config
        self.manager = manager
        self.gateway = gateway
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    @classmethod
    async def start(cls, config: RollfleetConfig, codec: Optional[TextCodec] = None) -> "GatewayStack":
        from rollfleet.manager import LLMServerManager

        gw_cfg = config.gateway
        check_can_listen(gw_cfg.host, gw_cfg.port)  # before Ray and the fleet: a taken port is a config error
        codec = codec or TextCodec.load(gw_cfg.tokenizer or config.rollout.model)
        config = fit_sim_to_tokenizer(config, codec)
        manager = await LLMServerManager.create(config)
        try:
            rollout = config.rollout
            retry = rollout.retry.model_copy(update={"no_server_wait_s": gw_cfg.no_server_wait_s})
            client = manager.get_client(FullyAsyncLLMServerClient, config=rollout.model_copy(update={"retry": retry}))
            holder: dict[str, GatewayStack] = {}

            async def refresh_scrape_config() -> None:
                if gw_cfg.prometheus_file and "stack" in holder:
                    await holder["stack"].write_prometheus_config()

            gateway = Gateway(
                client,
                codec,
                config=gw_cfg,
                rollout=config.rollout,
                admin=manager,
                on_membership_change=refresh_scrape_config,
            )
            server = GatewayServer(
                gateway.app,
                gw_cfg.host,
                gw_cfg.port,
                access_log=gw_cfg.access_log,
                header_timeout_s=gw_cfg.header_timeout_s,
                max_connections=gw_cfg.max_connections,
            )
            await server.start()
        except BaseException:
            await manager.shutdown()
            raise
        stack = holder["stack"] = cls(config, manager, gateway, server)
        if gw_cfg.prometheus_file:
            try:
                await stack.write_prometheus_config()
            except Exception as exc:  # serving matters more than monitoring: warn, keep going
                logger.warning("Prometheus config not updated: %s", exc)
        return stack

    async def write_prometheus_config(self) -> dict[str, Any]:
        """(Re)write the scrape config for the current replicas and the gateway, then reload."""
        cfg = self.config.gateway
        assert cfg.prometheus_file
        addresses = await self.manager.get_addresses()
        prom = PrometheusConfig(
            file=cfg.prometheus_file, port=cfg.prometheus_port, scrape_interval=cfg.prometheus_scrape_interval
        )
        gateway_address = self.url.split("://", 1)[1]
        return await asyncio.to_thread(
            update_prometheus_config, prom, addresses, self.config.rollout.name, gateway_address=gateway_address
        )

    async def stop(self) -> None:
        try:
            await self.server.stop()
        finally:
            await self.manager.shutdown()


async def serve(
    config: RollfleetConfig, *, announce: Callable[[str], None] = print, stop: Optional[asyncio.Event] = None
) -> int:
    """Run until SIGINT/SIGTERM (or ``stop`` is set), then shut everything down."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def install_handlers() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
                continue
            if sig not in installed:
                installed.append(sig)

    install_handlers()  # a Ctrl-C during start-up still shuts down cleanly
    try:
        stack = await GatewayStack.start(config)
        install_handlers()  # ray.init replaces the SIGTERM handler with its own (sys.exit): take it back
        try:
            announce(stack.url)
            await stop.wait()
        finally:
            await stack.stop()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    return 0


__all__ = ["fit_sim_to_tokenizer", "GatewayStack", "serve"]
