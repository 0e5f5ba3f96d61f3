"""``AgentLoopManager``: fans a batch of prompts out to agent-loop workers and pads the result.

Each prompt is repeated ``rollout.n`` times (a GRPO group sharing one ``uid``); whole groups go to
workers in turn (so a group's trajectories share a worker, its client, and thus the replica-side
prefix cache of their common prompt), every worker runs its trajectories concurrently (at most
``agent.max_concurrent_trajectories``), and the outputs come back in batch order as one
:class:`RolloutBatch`.

Workers are Ray actors, each given the caller's ``llm_client`` (pickled, so rebuilt in the actor
as a new client of the same fleet with the same settings: how a trainer hands out
``get_llm_client()``) or building its own from the fleet controller's handle (see
:mod:`rollfleet.agent_loop.worker` for why); or, when ``create`` gets a ready ``llm_client`` and
no server manager, in-process workers sharing that client (no Ray needed beyond the fleet itself).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Mapping, Optional, Sequence, Union

from rollfleet.agent_loop.base import AgentLoopOutput
from rollfleet.agent_loop.batch import RolloutBatch, collate
from rollfleet.agent_loop.tools import ToolsLike
from rollfleet.agent_loop.worker import AgentLoopWorker, AgentLoopWorkerActor, load_tokenizer
from rollfleet.config import RollfleetConfig
from rollfleet.utils.aio import auto_await, gather_or_cancel
from rollfleet.utils.refs import cancel

Batch = Union[Sequence[Mapping[str, Any]], Mapping[str, Sequence[Any]]]


class WorkerRef:
    """Calls a worker the same way whether it is a Ray actor or an in-process object."""

    def __init__(self, target: Any, remote: bool) -> None:
        self.target = target
        self.remote = remote

    async def call(self, method: str, *args: Any) -> Any:
        fn = getattr(self.target, method)
        if not self.remote:
            return await fn(*args)
        ref = fn.remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            cancel(ref)  # the actor's call goes on otherwise, generating on the fleet for nobody
            raise


def as_samples(batch: Batch) -> list[dict[str, Any]]:
    """A list of sample dicts from a list of dicts or a dict of equal-length columns."""
    if isinstance(batch, Mapping):
        keys = list(batch)
        sizes = {len(batch[k]) for k in keys}
        if len(sizes) > 1:
            raise ValueError(f"batch columns differ in length: { {k: len(batch[k]) for k in keys} }")
        size = sizes.pop() if sizes else 0
        return [{k: batch[k][i] for k in keys} for i in range(size)]
    return [dict(s) for s in batch]


def expand_groups(samples: Sequence[Mapping[str, Any]], n: int, deterministic: bool = False) -> list[dict[str, Any]]:
    """Repeat each prompt ``n`` times; the copies share a ``uid`` (the sample's, else a new one).

    ``deterministic``: the uid and request ids are named after the sample's ``task_index`` (its
    place in the batch when it has none), the same in every run. Not after the place alone: the
    async trainers expand one prompt at a time, and every group would be ``group-0``, one GRPO
    group across prompts, its requests sharing ids with the groups in flight beside it.

    A sample's own ``request_id`` names a trajectory; its ``n`` copies are ``n`` trajectories, so
    each gets it with its index (``row-17-0``, ``row-17-1``...). Shared, the siblings shared one
    session: one instance of each tool (each read and wrote the other's state, and the first to end
    released it under the other), one sticky entry, one id an abort stopped both by."""
    out = []
    for i, sample in enumerate(samples):
        key = sample.get("task_index", i)
        uid = str(sample.get("uid") or (f"group-{key}" if deterministic else uuid.uuid4().hex))
        given = sample.get("request_id")
        for j in range(n):
            copy = dict(sample, uid=uid, sample_index=j)
            if given and n > 1:
                copy["request_id"] = f"{given}-{j}"
            elif deterministic and not given:
                copy["request_id"] = f"det-{key}-{j}"  # stable session keys route the same way every run
            out.append(copy)
    return out


class AgentLoopManager:
    """Drives ``agent.num_workers`` agent-loop workers over one fleet. Build with :meth:`create`."""

    def __init__(
        self,
        config: RollfleetConfig,
        workers: list[WorkerRef],
        pad_token_id: int,
        server_manager: Any = None,
        owns_server_manager: bool = False,
    ) -> None:
        self.config = config
        self.workers = workers
        self.pad_token_id = pad_token_id
        self.server_manager = server_manager
        self._owns_server_manager = owns_server_manager
        self._next_worker = 0

    #: Client class the workers build when none is given.
    default_client_cls: Optional[type] = None

    @classmethod
    @auto_await
    async def create(
        cls,
        config: Union[RollfleetConfig, dict, None] = None,
        llm_client: Any = None,
        server_manager: Any = None,
        *,
        tools: ToolsLike = None,
        client_cls: Optional[type] = None,
        client_kwargs: Optional[Mapping[str, Any]] = None,
        tokenizer: Any = None,
    ) -> "AgentLoopManager":
        """Start the workers.

        * ``llm_client`` and ``server_manager`` given: one Ray actor per worker, each receiving
          ``llm_client`` pickled, i.e. rebuilt in the actor as a client of the same class and
          settings on the same controller (``LLMServerClient.__reduce__``), which the actor owns
          and closes. The caller still owns (and closes) its own ``llm_client``; a trainer's comes
          from ``server_manager.get_client``, which closes it on ``shutdown``.
        * only ``llm_client`` given: ``agent.num_workers`` in-process workers share it (and
          ``tokenizer``, loaded from ``rollout.model`` when None); the caller closes it.
        * else ``server_manager`` given (or, when neither is, one is created and owned): one Ray
          actor per worker, each building a ``client_cls`` client (``client_kwargs`` to its
          constructor) on ``server_manager.controller``.

        Ray actors load ``rollout.model``'s tokenizer themselves. ``tools`` are pickled to the
        actors: their functions must be importable there (or registered with
        ``ray.cloudpickle.register_pickle_by_value``). ``client_cls``/``client_kwargs`` together
        with ``llm_client`` is a ``ValueError``: the client already fixes both.
        """
        if isinstance(config, dict) or config is None:
            config = RollfleetConfig.model_validate(config or {})
        if llm_client is not None and (client_cls is not None or client_kwargs is not None):
            raise ValueError(
                "pass either llm_client or client_cls/client_kwargs, not both: "
                "a ready client already fixes its class and settings"
            )
        num = config.agent.num_workers
        owns = False
        if llm_client is not None and server_manager is None:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.rollout.model)
            refs = [
                WorkerRef(AgentLoopWorker(config, client=llm_client, tokenizer=tokenizer, tools=tools), remote=False)
                for _ in range(num)
            ]
        else:
            if server_manager is None:
                from rollfleet.manager import LLMServerManager

                server_manager = await LLMServerManager.create(config)
                owns = True
            if llm_client is not None:  # pickled per actor: each gets its own copy (owned there)
                client_args: dict[str, Any] = {"client": llm_client}
            else:
                client_args = {
                    "controller": server_manager.controller,
                    "client_cls": client_cls or cls.default_client_cls,
                    "client_kwargs": dict(client_kwargs or {}),
                }
            refs = [
                WorkerRef(AgentLoopWorkerActor.remote(config, tools=tools, **client_args), remote=True)  # type: ignore[attr-defined]  # a Ray actor class
                for _ in range(num)
            ]
        infos = await asyncio.gather(*(r.call("ready") for r in refs))
        return cls(config, refs, int(infos[0]["pad_token_id"]), server_manager, owns)

    # ------------------------------------------------------------------ batches
    def expand(self, batch: Batch, n: Optional[int] = None) -> list[dict[str, Any]]:
        """Samples of a batch, each prompt repeated ``n`` (default ``rollout.n``) times."""
        return expand_groups(as_samples(batch), n or self.config.rollout.n, self.config.rollout.full_determinism)

    @auto_await
    async def generate_sequences(self, batch: Batch, *, n: Optional[int] = None) -> RolloutBatch:
        """Run every sample of ``batch`` (``rollout.n`` times each) and return the padded batch.

        A sample is a dict with ``raw_prompt`` (chat messages) or ``prompt_ids``, and optionally
        ``agent_name``, ``tools_kwargs``, ``tool_selection``, ``reward`` (``{"name", "ground_truth",
        ...}``), ``sampling_params`` (overrides), ``uid``.
        """
        samples = self.expand(batch, n)
        start = time.perf_counter()
        chunks = self._assign(samples)
        # one worker's chunk failing ends the others' too (left running, they would go on generating)
        results = await gather_or_cancel(
            self.workers[w].call("generate_sequences", [samples[i] for i in idx]) for w, idx in chunks.items()
        )
        outputs: list[Optional[AgentLoopOutput]] = [None] * len(samples)
        for (_, idx), outs in zip(chunks.items(), results):
            for i, out in zip(idx, outs):
                outputs[i] = out
        result = self.collate(outputs, [s["uid"] for s in samples])  # type: ignore[arg-type]
        result.metrics["agent_loop/generate_sequences_wall_s"] = time.perf_counter() - start
        return result

    def _assign(self, samples: Sequence[Mapping[str, Any]]) -> dict[int, list[int]]:
        """Whole groups to workers in turn; worker -> sample indices (in batch order)."""
        chunks: dict[int, list[int]] = {}
        worker_of_group: dict[str, int] = {}
        for i, sample in enumerate(samples):
            w = worker_of_group.get(sample["uid"])
            if w is None:
                w = worker_of_group[sample["uid"]] = self._next_worker
                self._next_worker = (self._next_worker + 1) % len(self.workers)
            chunks.setdefault(w, []).append(i)
        return chunks

    def collate(self, outputs: Sequence[AgentLoopOutput], uids: Sequence[str]) -> RolloutBatch:
        rollout = self.config.rollout
        return collate(
            outputs,
            uids,
            prompt_length=rollout.prompt_length,
            response_length=rollout.response_length,
            pad_token_id=self.pad_token_id,
        )

    # ------------------------------------------------------------------ lifecycle
    @auto_await
    async def shutdown(self) -> None:
        """Close the workers' clients, stop worker actors, and the fleet if this manager made it."""
        await asyncio.gather(*(w.call("close") for w in self.workers), return_exceptions=True)
        if any(w.remote for w in self.workers):
            import ray

            for w in self.workers:
                if w.remote:
                    ray.kill(w.target, no_restart=True)
        self.workers = []
        if self._owns_server_manager and self.server_manager is not None:
            await self.server_manager.shutdown()
            self.server_manager = None


__all__ = ["AgentLoopManager", "WorkerRef", "as_samples", "expand_groups"]
