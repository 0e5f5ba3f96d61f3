"""``LLMServerManager``: launch and run the fleet; hand out clients.

The manager is a thin driver-side facade over the fleet controller actor (control plane) and
never touches the data plane: clients it hands out route requests straight to replicas. Every
method is async and also callable from synchronous code (``auto_await``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional, Union

from rollfleet.config import RayConfig, RollfleetConfig, RolloutConfig
from rollfleet.manager.fanout import CALLER_ERRORS, WeightsRef
from rollfleet.manager.ray_runtime import ensure_ray
from rollfleet.records import FleetStatus, ReplicaInfo
from rollfleet.utils.aio import auto_await

logger = logging.getLogger(__name__)

#: How long a shutdown waits for the controller to stop the fleet itself. It stops the replicas
#: still starting (10 s at most) and then every replica (30 s at most each, all at once); a
#: controller past this is wedged, and is killed: the replica actors it owns die with it.
CONTROLLER_SHUTDOWN_TIMEOUT_S = 60.0


async def _answer(ref: Any) -> Any:
    """A controller call's result. A caller's mistake the fleet refused (a bad argument, an op the
    engine cannot do) is raised as itself, not inside Ray's task error, whose message is a remote
    traceback: the gateway shows callers that message."""
    try:
        return await ref
    except Exception as exc:
        cause = getattr(exc, "cause", None)  # Ray's task error -> the controller's own error
        if isinstance(cause, CALLER_ERRORS):
            raise cause from exc  # the remote traceback stays in the chain, for logs
        raise


class LLMServerManager:
    def __init__(self, config: Union[RollfleetConfig, RolloutConfig, dict, None] = None) -> None:
        if isinstance(config, dict):
            config = RollfleetConfig.model_validate(config)
        if isinstance(config, RolloutConfig):
            config = RollfleetConfig(rollout=config)
        self.full_config: RollfleetConfig = config or RollfleetConfig()
        self.config: RolloutConfig = self.full_config.rollout
        self.ray_config: RayConfig = self.full_config.ray
        self.controller: Any = None
        self._started_ray = False
        self._clients: list[Any] = []

    @classmethod
    @auto_await
    async def create(cls, config: Union[RollfleetConfig, RolloutConfig, dict, None] = None) -> "LLMServerManager":
        """Start Ray if needed, the controller, and ``rollout.num_replicas`` replicas."""
        self = cls(config)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rollfleet.manager.controller import FleetControllerActor

        self._started_ray = ensure_ray(self.ray_config)
        # The controller runs on the driver's node: the scrape config it writes lands where the
        # driver's Prometheus reads it, and it lives exactly as long as the node the job lives on
        # (Ray's soft affinity was seen placing it on another node, which may die). A Ray-client
        # driver (ray://) is on no node of the cluster: Ray chooses.
        fleet_id = uuid.uuid4().hex[:8]
        if self.config.weight_sync.stage_key is None:  # this fleet's replicas share staged weights per node
            self.config = self.config.model_copy(
                update={"weight_sync": self.config.weight_sync.model_copy(update={"stage_key": f"fleet-{fleet_id}"})}
            )
        options: dict[str, Any] = {"name": f"rollfleet-controller-{fleet_id}"}
        if not ray.util.client.ray.is_connected():
            here = ray.get_runtime_context().get_node_id()
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
        self.controller = FleetControllerActor.options(**options).remote(self.config)  # type: ignore[attr-defined]  # a Ray actor class
        try:
            await _answer(self.controller.launch.remote(self.config.num_replicas, 0))
        except BaseException:
            await self._teardown()
            raise
        logger.info("fleet up: %d %s replicas", self.config.num_replicas, self.config.name)
        return self

    # ------------------------------------------------------------------ clients
    def get_client(self, client_cls: Optional[type] = None, **kwargs: Any) -> Any:
        """A client routed over this fleet (``LLMServerClient`` unless ``client_cls`` is given).

        ``config`` (a ``RolloutConfig``) may override the fleet's for this client only, e.g. its
        retry policy; other keyword arguments go to the client's constructor."""
        import ray

        # The one upward reference of this layer, by verl's contract: the manager hands out
        # clients. Imported here so the manager module itself depends only on layers below it.
        from rollfleet.client import LLMServerClient

        cls = client_cls or LLMServerClient
        if not (isinstance(cls, type) and issubclass(cls, LLMServerClient)):
            raise TypeError(f"client_cls must be a subclass of LLMServerClient, got {cls!r}")
        snapshot = ray.get(self.controller.snapshot.remote(-1))
        config = kwargs.pop("config", None) or self.config  # e.g. a gateway's shorter retry waits
        client = cls(config, servers=dict(snapshot.handles or {}), controller=self.controller, **kwargs)
        client.fleet.apply(snapshot)
        self._clients.append(client)
        return client

    # ------------------------------------------------------------------ membership
    @auto_await
    async def get_replicas(self) -> list[ReplicaInfo]:
        return await _answer(self.controller.get_replicas.remote())

    @auto_await
    async def get_addresses(self) -> list[str]:
        return [r.address for r in await self.controller.get_replicas.remote()]

    @auto_await
    async def learner_placement(self) -> Any:
        """Where the learner should run (a ``WorkerPlacement``: ``actor_options()`` for
        ``Actor.options``): on the first replica's devices when ``rollout.placement.colocate``,
        else on a device of its own that this fleet reserves (released at shutdown); None when
        the fleet reserves nothing (sim engine without GPUs, ``placement.device: none``)."""
        return await _answer(self.controller.learner_placement.remote())

    @auto_await
    async def add_replicas(self, n: int) -> list[ReplicaInfo]:
        return await _answer(self.controller.add_replicas.remote(n))

    @auto_await
    async def remove_replicas(self, replica_ids: list[str], drain_timeout_s: float = 30.0) -> list[str]:
        # a bare id is refused there, naming the field (list() made it its characters: nothing removed)
        ids = replica_ids if isinstance(replica_ids, str) else list(replica_ids)
        return await _answer(self.controller.remove_replicas.remote(ids, drain_timeout_s))

    # ------------------------------------------------------------------ control plane
    @auto_await
    async def abort_all(self) -> dict[str, Any]:
        return await _answer(self.controller.abort_all.remote())

    @auto_await
    async def pause(self) -> None:
        await _answer(self.controller.pause.remote())

    @auto_await
    async def resume(self) -> None:
        await _answer(self.controller.resume.remote())

    @auto_await
    async def sleep(self) -> None:
        await _answer(self.controller.sleep.remote())

    @auto_await
    async def wake_up(self) -> None:
        await _answer(self.controller.wake_up.remote())

    @auto_await
    async def clear_kv_cache(self) -> None:
        await _answer(self.controller.clear_kv_cache.remote())

    @auto_await
    async def update_weights(self, weights: Any, version: int, mode: Optional[str] = None) -> dict[str, Any]:
        """Push new weights to every replica under ``version`` (which must increase).

        Two phases (see :mod:`rollfleet.manager.weight_updates`): the replicas stage the weights while
        the fleet keeps generating, then commit them in ``mode`` (``rollout.weight_sync.mode``
        unless given): ``keep`` continues in-flight requests on the new weights, ``abort`` returns
        them ``aborted`` with their partial tokens (``FullyAsyncLLMServerClient`` resumes them),
        ``rolling`` commits in waves. The weights are put in Ray's object store once; the
        controller gets and keeps only the reference.
        """
        import ray

        ref = weights if isinstance(weights, ray.ObjectRef) or weights is None else ray.put(weights)
        return await _answer(self.controller.update_weights.remote(WeightsRef(ref), version, mode))

    @auto_await
    async def weights_checksums(self) -> dict[str, Optional[str]]:
        """Each live replica's weight digest (None where its engine cannot tell): after a verified
        update they are all equal."""
        return await _answer(self.controller.weights_checksums.remote())

    @auto_await
    async def start_profile(self, **kwargs: Any) -> None:
        await _answer(self.controller.start_profile.remote(**kwargs))

    @auto_await
    async def stop_profile(self) -> dict[str, Any]:
        return await _answer(self.controller.stop_profile.remote())

    @auto_await
    async def status(self) -> FleetStatus:
        status: FleetStatus = await _answer(self.controller.status.remote())
        return status.model_copy(update={"clients": [c.get_status() for c in self._clients]})

    @auto_await
    async def replica_stats(self) -> dict[str, Any]:
        return await _answer(self.controller.replica_stats.remote())

    @auto_await
    async def inject_fault(self, replica_id: str, kind: str, factor: float = 10.0) -> None:
        """Test hook: make one replica crash, hang or slow down (sim engine)."""
        await _answer(self.controller.inject_fault.remote(replica_id, kind, factor))

    @auto_await
    async def script_responses(self, script: Any) -> None:
        """Test hook: ``script(request_id, prompt_ids, sampling_params) -> token ids`` decides every
        response on every replica (sim engine only; tool-calling tests use it)."""
        await _answer(self.controller.script_responses.remote(script))

    @auto_await
    async def shutdown(self) -> None:
        """Stop every replica and the controller; stop Ray if this manager started it."""
        for client in self._clients:
            try:
                await client.close()
            except Exception:
                pass
        self._clients.clear()
        await self._teardown()

    async def _teardown(self) -> None:
        import ray

        if self.controller is not None:
            try:
                await asyncio.wait_for(self.controller.shutdown.remote(), CONTROLLER_SHUTDOWN_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.error(
                    "the fleet controller did not shut down within %.0f s; killing it (its replicas with it)",
                    CONTROLLER_SHUTDOWN_TIMEOUT_S,
                )
            except Exception:
                logger.exception("controller shutdown failed")
            try:
                ray.kill(self.controller, no_restart=True)
            except Exception:  # already gone (its node died, or Ray was restarted under us)
                logger.warning("controller could not be killed: it is already gone", exc_info=True)
            self.controller = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


__all__ = ["LLMServerManager"]
