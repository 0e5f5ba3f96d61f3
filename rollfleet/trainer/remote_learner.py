"""The learner in a Ray actor of its own; the trainer drives it through an async proxy.

The driver only drives: it builds a picklable :class:`LearnerSpec` (configs and a model name, no
model), :meth:`RemoteLearner.create` starts a :class:`LearnerActor` where the fleet says the
learner goes (``manager.learner_placement()``: a share of a replica's device when colocated, a
device of its own otherwise, nothing for a fleet that reserves nothing) and the actor builds the
learner in its own process. Weights never pass through the driver:
:meth:`RemoteLearner.state_dict_for_inference` returns the actor call's ``ObjectRef``, which
``manager.update_weights`` forwards as is.

Why a sync actor (one call at a time, on the actor's main thread) and not an async one: the
learner's calls are heavy, GIL- and torch-bound and strictly sequential (update, then weights,
then checkpoint). In an async actor each would block the event loop or need a thread hop; a sync
actor runs them in the order the trainer sent them, so weights asked for after an update are the
updated ones. Traded away: ``where()`` waits behind a running update.

Torch threads (:func:`torch_threads`): Ray sets ``OMP_NUM_THREADS`` to the floor of the CPUs an
actor reserved, 1 when it reserved less than one or none, which is what a learner here reserves
(no placement: 0 CPUs; colocated: a fraction of one device's CPUs). On a GPU that is harmless, the
device does the work, and we follow Ray (the reserved CPUs, at least 1). On a CPU-only learner
the update *is* CPU work and Ray's CPU count is a logical reservation (the embedded cluster's
``num_cpus`` need not be the cores), so it gets every core of the process's CPU affinity, as it
had in the driver; in ``separate_async`` on CPU nodes it competes with CPU replicas, as before.

Checkpoints are written by the actor, on its node: paths are made absolute in the driver, and a
learner on another node needs ``output_dir`` on a shared filesystem.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerSpec:
    """What to build in the learner's process: ``torch`` (``Learner(model, config)``) or ``sim``
    (``SimulatedLearner(config)``). Picklable; calling it builds the learner."""

    kind: Literal["torch", "sim"]
    config: Any  # LearnerConfig | SimLearnerConfig
    model: str = ""

    def __call__(self) -> Any:
        if self.kind == "sim":
            from rollfleet.trainer.sim_learner import SimulatedLearner

            return SimulatedLearner(self.config)
        from rollfleet.trainer.learner import Learner

        return Learner(self.model, self.config)


def torch_threads(assigned: Mapping[str, float], cores: Optional[int] = None) -> int:
    """Intra-op threads for a learner that reserved ``assigned`` (see the module docstring)."""
    if assigned.get("GPU", 0.0) > 0:
        return max(1, int(assigned.get("CPU", 0.0)))
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores)


class LearnerHost:
    """Holds one learner built from a factory and forwards the trainer's calls (no Ray here)."""

    def __init__(self, factory: Any) -> None:
        self.learner = factory()

    def update(self, batch: Any) -> dict[str, float]:
        return self.learner.update(batch)

    def state_dict_for_inference(self) -> Any:
        return self.learner.state_dict_for_inference()

    def save(self, root: str, state: dict[str, Any]) -> Path:
        return self.learner.save(root, state)

    def load(self, root: str) -> dict[str, Any]:
        return self.learner.load(root)


try:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class LearnerActor(LearnerHost):
        """:class:`LearnerHost` in an actor of its own: sets torch's threads, then builds."""

        def __init__(self, factory: Any) -> None:
            import torch

            torch.set_num_threads(torch_threads(ray.get_runtime_context().get_assigned_resources()))
            super().__init__(factory)

        def where(self) -> dict[str, Any]:
            """Node id, accelerator ids, reserved resources, pid and torch threads of the learner."""
            import torch

            ctx = ray.get_runtime_context()
            return {
                "node_id": ctx.get_node_id(),
                "accelerator_ids": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v},
                "resources": ctx.get_assigned_resources(),
                "pid": os.getpid(),
                "torch_threads": torch.get_num_threads(),
            }

except ImportError:  # pragma: no cover
    LearnerActor = None  # type: ignore[assignment,misc]


class RemoteLearner:
    """The driver's handle on the learner actor: the learner's methods, as awaitables."""

    def __init__(self, handle: Any, info: dict[str, Any]) -> None:
        self.handle = handle
        #: ``where()`` as the actor answered it at start.
        self.info = info

    @classmethod
    async def create(cls, factory: Any, placement: Any = None) -> "RemoteLearner":
        """Start the actor (in ``placement``, a ``WorkerPlacement``; else with no reservation) and
        wait until the learner is built, so a bad model or config fails here."""
        options = placement.actor_options() if placement is not None else {"num_cpus": 0}
        handle = LearnerActor.options(**options).remote(factory)  # type: ignore[attr-defined]  # a Ray actor class
        try:
            info = await handle.where.remote()
        except BaseException:
            ray.kill(handle, no_restart=True)
            raise
        logger.info(
            "learner up: pid %s on node %s, devices %s, %s torch threads",
            info["pid"],
            info["node_id"][:8],
            info["accelerator_ids"],
            info["torch_threads"],
        )
        return cls(handle, info)

    async def update(self, batch: Any) -> dict[str, float]:
        return await self.handle.update.remote(batch)

    async def state_dict_for_inference(self) -> Any:
        """An ``ObjectRef`` to the weights (they stay in the object store, never in the driver)."""
        return self.handle.state_dict_for_inference.remote()

    async def save(self, root: str | Path, state: dict[str, Any]) -> Path:
        return await self.handle.save.remote(str(Path(root).absolute()), state)  # noqa: ASYNC240 - no I/O

    async def load(self, root: str | Path) -> dict[str, Any]:
        return await self.handle.load.remote(str(Path(root).absolute()))  # noqa: ASYNC240 - no I/O

    async def where(self) -> dict[str, Any]:
        return await self.handle.where.remote()

    def kill(self) -> None:
        ray.kill(self.handle, no_restart=True)


__all__ = ["LearnerActor", "LearnerHost", "LearnerSpec", "RemoteLearner", "torch_threads"]
