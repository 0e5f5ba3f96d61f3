"""ReplicaActor: the thin Ray actor around :class:`~rollfleet.server.replica.Replica`.

An asyncio actor (thousands of requests interleave in one process, as the engines expect) that
learns where it runs from Ray (its node's IP, the accelerator ids Ray assigned) when it starts;
placement itself is decided by the manager.
"""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.server.replica import Replica

try:  # Ray is a hard dependency, but keep the plain class importable without it for unit tests.
    import ray

    @ray.remote(max_concurrency=100_000)  # type: ignore[call-overload]  # Ray's stub omits actor options
    class ReplicaActor(Replica):
        """Ray actor around :class:`Replica` (asyncio actor; placement decided by the manager).

        With ``data_plane: direct`` (the default) it also listens for generate requests on a TCP
        port of its node (:mod:`rollfleet.server.dataplane`), reported as ``info()["data_plane"]``;
        the Ray methods stay available for everything, generate included.
        """

        async def start(  # type: ignore[override]
            self, version: Optional[int] = None, peer_devices: Optional[list[str]] = None
        ) -> dict[str, Any]:
            """Start on this node's IP with the devices Ray assigned: this actor's own (rank 0)
            followed by ``peer_devices`` (those of the group's other bundles)."""
            host = ray.util.get_node_ip_address()
            own = list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))
            devices = own + list(peer_devices or []) if (own or peer_devices) else None
            await super().start(version, host=host, devices=devices)
            if self.config.data_plane == "direct":
                await self.serve_data_plane(host)
            return self.info()

except ImportError:  # pragma: no cover
    ReplicaActor = None  # type: ignore[assignment,misc]


__all__ = ["ReplicaActor"]
