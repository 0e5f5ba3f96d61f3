"""The trainer base: one loop shared by every mode, hooks where the modes differ.

``fit`` runs ``total_steps`` learner steps::

    on_train_begin
    per step: on_step_begin -> sample (mode: where generation happens and what we wait for)
              -> on_sample_end -> learner update (in the learner's actor: the event loop keeps routing)
              -> weight sync every parameter_sync_step steps (on_sync_begin / on_sync_end)
              -> on_step_end -> metrics, checkpoint
    on_train_end

A trainer gets its client from the fleet (``get_llm_client``): the plain client for ``sync``, the
fully-async client for the async modes, which make weight updates invisible to in-flight
trajectories. Weight sync pushes the learner's weights with ``manager.update_weights(weights,
version)``: pause -> load -> clear prefix caches -> stamp version -> resume on every replica.

Where the fleet, the learner and the agent-loop workers run, and which clock times the steps, is
the trainer's runtime (:mod:`rollfleet.trainer.runtime`): Ray and wall time for a training run,
one process and a virtual clock for a plan (:class:`rollfleet.plan.VirtualRuntime`). On Ray, the
learner runs in a Ray actor of its own (:mod:`rollfleet.trainer.remote_learner`), placed where
the fleet says (``manager.learner_placement()``), so the fleet comes up first. Whether it shares
the replicas' devices is the mode's ``colocated_by_default`` unless ``trainer.colocate`` says
otherwise; the trainer writes the answer into ``rollout.placement.colocate`` of its copy of the
config.
"""

from __future__ import annotations

import abc
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Any, ClassVar, Optional

from rollfleet.agent_loop import FullyAsyncAgentLoopManager
from rollfleet.client import FullyAsyncLLMServerClient, LLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager
from rollfleet.trainer.config import TrainConfig
from rollfleet.trainer.remote_learner import LearnerSpec, RemoteLearner
from rollfleet.trainer.runtime import RayRuntime, TrainerRuntime
from rollfleet.trainer.staleness import Group
from rollfleet.trainer.step_log import StepLog
from rollfleet.trainer.tasks import make_task
from rollfleet.trainer.tracking import RunTracker

logger = logging.getLogger(__name__)


class Trainer(StepLog, abc.ABC):
    """Subclass, implement :meth:`sample`, register with ``@register_trainer(name)``."""

    mode_name: ClassVar[str] = "base"
    #: The client the mode's trajectories use.
    client_cls: ClassVar[type[LLMServerClient]] = FullyAsyncLLMServerClient
    #: Whether the learner shares the replicas' devices unless ``trainer.colocate`` says otherwise.
    colocated_by_default: ClassVar[bool] = True

    def __init__(
        self, config: RollfleetConfig, *, progress: Any = None, runtime: Optional[TrainerRuntime] = None
    ) -> None:
        #: Where the fleet, learner and workers run and which clock times the steps (Ray, wall time).
        self.runtime = runtime or RayRuntime()
        self.train = TrainConfig.model_validate(config.trainer.model_dump())
        self.config = self._with_colocation(config)
        self.run_dir = Path(self.train.output_dir) / self.train.run_name
        self.manager: Optional[LLMServerManager] = None
        self.agent_manager: Optional[FullyAsyncAgentLoopManager] = None
        self.learner: Optional[RemoteLearner] = None
        self.tracker: Optional[RunTracker] = None
        self.stream = make_task(self.train.task, self.train.seed, prompt_tokens=self.config.rollout.prompt_length)
        self.step = 0
        self.version = 0
        self.syncs = 0
        self.progress = progress
        self._reissue: list[int] = []
        self._last_step_end = 0.0
        self._tokens_at_last_step = 0
        self.trained_tokens = 0
        #: Per step: staleness of every trained group and the longest trained response (audit trail).
        self.trained_log: list[dict[str, Any]] = []
        self.idle_s = 0.0
        self.wall_s = 0.0

    # ------------------------------------------------------------------ set-up
    def get_llm_client(self) -> LLMServerClient:
        assert self.manager is not None, "call init() first"
        return self.manager.get_client(client_cls=self.client_cls, **self.client_kwargs())

    def client_kwargs(self) -> dict[str, Any]:
        if issubclass(self.client_cls, FullyAsyncLLMServerClient):
            return {"partial_rollout": self.train.partial_rollout}
        return {}

    def _with_colocation(self, config: RollfleetConfig) -> RollfleetConfig:
        """A copy of ``config`` whose ``rollout.placement.colocate`` is this run's answer."""
        colocate = self.colocated_by_default if self.train.colocate is None else self.train.colocate
        placement = config.rollout.placement.model_copy(update={"colocate": colocate})
        rollout = config.rollout.model_copy(update={"placement": placement})
        return config.model_copy(update={"rollout": rollout})

    def build_learner(self) -> Any:
        """A picklable factory of the learner, called in the learner's actor (override to train
        something else: any zero-argument picklable callable returning an object with ``update``,
        ``state_dict_for_inference``, ``save`` and ``load``)."""
        if self.train.sim_learner.enabled:
            return LearnerSpec("sim", self.train.sim_learner)
        learner_cfg = self.train.learner
        temperature = self.config.rollout.temperature
        if temperature > 0 and learner_cfg.temperature != temperature:
            learner_cfg = learner_cfg.model_copy(update={"temperature": temperature})
        model = self.config.rollout.model
        if os.path.exists(os.path.expanduser(model)):  # a local folder: the actor's cwd may differ
            model = os.path.abspath(os.path.expanduser(model))
        return LearnerSpec("torch", learner_cfg, model)

    async def init(self) -> None:
        self.tracker = RunTracker(self.run_dir, resume=self.train.resume, clock=self.runtime.clock)
        if not self.train.resume:
            from rollfleet.trainer.checkpoint import set_aside

            moved = set_aside(self.run_dir / "checkpoints")
            if moved is not None:
                logger.warning("a fresh run (trainer.resume=false): the earlier run's checkpoints moved to %s", moved)
        # The fleet first: it starts Ray and says where the learner goes.
        self.manager = await self.runtime.create_fleet(self.config)
        self.learner = await self.runtime.create_learner(self.build_learner(), self.manager)
        self.agent_manager = await self.runtime.create_agent_manager(self.config, self.get_llm_client(), self.manager)
        if self.train.resume:
            await self._resume()

    async def _resume(self) -> None:
        assert self.manager is not None and self.learner is not None and self.tracker is not None  # made by init()
        ckpt_root = self.run_dir / "checkpoints"
        from rollfleet.trainer.checkpoint import aside_of, find_latest

        if find_latest(ckpt_root) is None:
            aside = aside_of(ckpt_root)
            hint = f" (the run before the last fresh one left {aside})" if find_latest(aside) else ""
            logger.warning("resume requested but no checkpoint under %s%s: starting fresh", ckpt_root, hint)
            self.tracker.resume_at(0)
            return
        state = await self.learner.load(ckpt_root)
        self.step = int(state.get("step", 0))
        self.syncs = int(state.get("syncs", 0))
        self.tracker.resume_at(self.step)
        self._session_rows_from = len(self.tracker.history)
        self._totals_before = dict(state.get("run_totals", {}))
        self.stream.position = int(state.get("data_position", 0))
        self._reissue = [int(i) for i in state.get("inflight_task_indices", [])]
        # The fleet booted on the base weights: push the checkpoint's under a new version.
        self.version = int(state.get("version", 0)) + 1
        await self.manager.update_weights(await self.learner.state_dict_for_inference(), self.version)
        logger.info(
            "resumed at step %d, weight version %d, re-issuing %d prompts", self.step, self.version, len(self._reissue)
        )

    # ------------------------------------------------------------------ the loop
    @abc.abstractmethod
    async def sample(self) -> tuple[list[Group], dict[str, Any]]:
        """Return the groups to train on at this step and mode-specific metrics."""

    async def on_train_begin(self) -> None: ...

    async def on_step_begin(self) -> None: ...

    async def on_sample_end(self) -> None: ...

    async def on_sync_begin(self) -> None: ...

    async def on_sync_end(self) -> None: ...

    async def on_step_end(self) -> None: ...

    async def on_train_end(self) -> None: ...

    def inflight_task_indices(self) -> list[int]:
        """Prompts taken from the stream but not trained on (re-issued after a resume)."""
        return sorted(self._reissue)

    async def fit(self) -> dict[str, Any]:
        assert self.manager is not None and self.tracker is not None
        t_start = self.runtime.clock()
        self._last_step_end = t_start
        await self.on_train_begin()
        try:
            while self.step < self.train.total_steps:
                self.step += 1
                await self.on_step_begin()
                t0 = self.runtime.clock()
                groups, info = await self.sample()
                t1 = self.runtime.clock()
                self.tracker.span_event("trainer", "wait", t0, t1, step=self.step)
                await self.on_sample_end()
                metrics, trained = await self._train_on(groups)
                synced = False
                if self.step % self.train.parameter_sync_step == 0:
                    await self.sync_weights()
                    synced = True
                await self.on_step_end()
                self._log_step(groups, info, metrics, trained, wait_s=t1 - t0, synced=synced)
                if self.train.save_freq and self.step % self.train.save_freq == 0:
                    await self.save_checkpoint()
        finally:
            await self.on_train_end()
        self.wall_s = self.runtime.clock() - t_start
        await self.save_checkpoint()
        return self.summary()

    async def _train_on(self, groups: list[Group]) -> tuple[dict[str, Any], int]:
        """Train on ``groups``; returns the learner's metrics and the response tokens in the loss
        (what was left out of it, and masked off-policy tokens, are not counted as trained)."""
        assert self.agent_manager is not None and self.tracker is not None and self.learner is not None
        outputs = [o for g in groups for o in g.outputs]
        errors = [o.extra_fields["reward_error"] for o in outputs if o.extra_fields.get("reward_error")]
        if outputs and len(errors) == len(outputs):  # a reward function that fails on everything is broken
            raise RuntimeError(f"every sample's reward failed at step {self.step}, the first: {errors[0]}")
        owners = [g.uid for g in groups for _ in g.outputs]
        # A sample the loss never sees (no reward; a partial whose resumption gave up) must not move
        # its group's baseline either: it is a group of its own (advantage 0), out of the rewards.
        left_out = [o.reward_score is None or bool(o.extra_fields.get("resume_exhausted")) for o in outputs]
        uids = [f"{uid}#left-out-{k}" if out else uid for k, (uid, out) in enumerate(zip(owners, left_out))]
        batch = self.agent_manager.collate(outputs, uids)
        unscored = ~batch.has_score
        if unscored.any():  # never train on a sample without a reward
            batch.response_mask[unscored] = 0
        masked = self._mask_off_policy(batch)
        with self.tracker.span("trainer", "train", step=self.step):
            metrics = await self.learner.update(batch)
        metrics.update(masked)
        kept = [float(o.reward_score) for o, out in zip(outputs, left_out) if not out and o.reward_score is not None]
        metrics["rollout/left_out_of_baseline"] = float(sum(left_out))
        metrics["reward/errors"] = float(len(errors))
        metrics["reward/mean"] = statistics.fmean(kept) if kept else 0.0
        metrics["reward/max"] = max(kept, default=0.0)
        metrics["response_length/mean"] = float(batch.response_lengths.float().mean())
        widths = batch.response_lengths.tolist()  # what collate kept of each response
        in_loss = sum(int(sum(o.response_mask[:n])) for o, n, out in zip(outputs, widths, left_out) if not out)
        return metrics, in_loss - int(masked.get("staleness/masked_tokens", 0))

    def _mask_off_policy(self, batch: Any) -> dict[str, float]:
        """Take out of the loss what must not be trained on: partial responses whose resumption
        gave up (never trained as if complete) and, with ``max_off_policy_strategy: mask``, every
        token sampled more than the bound ago (its exact version: ``batch.token_versions``)."""
        out = {"rollout/resume_exhausted_masked": float(batch.resume_exhausted.sum())}
        if batch.resume_exhausted.any():  # reading response_mask builds the padded tensors
            batch.response_mask[batch.resume_exhausted] = 0
        if self.train.max_off_policy_strategy == "mask":
            limit = math.ceil(self.train.max_off_policy_steps)
            stale = (batch.response_mask > 0) & (batch.token_versions >= 0)
            stale &= batch.token_versions < self.version - limit
            out["staleness/masked_tokens"] = float(stale.sum())
            batch.response_mask[stale] = 0
        return out

    def fleet_paused(self, at: Optional[float] = None) -> None:
        """Record that the fleet stopped generating (for the timeline), now or ``at`` (runtime clock)."""
        now = self.runtime.clock() if at is None else at
        if self._fleet_active_since is not None and self.tracker is not None:
            self.tracker.span_event("fleet", "generating", self._fleet_active_since, now)
        self._fleet_active_since = None
        self._fleet_paused_since = now

    def fleet_resumed(self, at: Optional[float] = None) -> None:
        now = self.runtime.clock() if at is None else at
        if self._fleet_paused_since is not None and self.tracker is not None:
            self.tracker.span_event("fleet", "paused", self._fleet_paused_since, now)
        self._fleet_paused_since = None
        self._fleet_active_since = now

    _fleet_active_since: Optional[float] = None
    _fleet_paused_since: Optional[float] = None

    async def sync_weights(self) -> None:
        assert self.manager is not None and self.tracker is not None and self.learner is not None
        await self.on_sync_begin()
        with self.tracker.span("trainer", "sync", step=self.step):
            weights = await self.learner.state_dict_for_inference()  # an ObjectRef
            generating = self._fleet_active_since is not None
            # Without partial rollout a response must come from one policy: interrupt, never keep.
            mode = None if self.train.partial_rollout else "abort"
            result = await self.manager.update_weights(weights, self.version + 1, mode)
            # Only now: the fleet generated on the old weights while the new ones staged, so a group
            # started meanwhile must count as started under the old version (the staleness bound).
            self.version += 1
            # The fleet generated through the staging; it stopped only while each commit wave ran,
            # and only when a wave was the whole fleet (not so in rolling mode).
            if generating and result.get("mode") != "rolling":
                for start, end in result.get("paused", []):
                    self.fleet_paused(at=start)
                    self.fleet_resumed(at=end)
        self.syncs += 1
        self._last_sync = result
        await self.on_sync_end()

    async def save_checkpoint(self) -> Path:
        assert self.learner is not None
        state = {
            "step": self.step,
            "version": self.version,
            "syncs": self.syncs,
            "data_position": self.stream.position,
            "inflight_task_indices": self.inflight_task_indices(),
            "mode": self.mode_name,
            "run_totals": self.run_totals(),
        }
        return await self.learner.save(self.run_dir / "checkpoints", state)

    async def close(self) -> None:
        if self.learner is not None:  # before the fleet: it may hold the learner's bundle
            try:
                self.learner.kill()
            except Exception:
                logger.exception("learner actor kill failed")
            self.learner = None
        if self.agent_manager is not None:
            try:
                await self.agent_manager.shutdown()
            except Exception:
                logger.exception("agent manager shutdown failed")
        if self.manager is not None:
            await self.manager.shutdown()


__all__ = ["Trainer"]
