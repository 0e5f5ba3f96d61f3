"""``AgentLoopWorker``: runs agent loops for samples over one client, then scores them.

How a worker gets its client (the decision, and why): a client's state is not shipped across
processes. It holds an in-process balancer, sticky sessions and an asyncio refresher task, none of
which survive pickling meaningfully, and the design wants sticky state to live where the
trajectory runs. So a client pickles as a recipe (its class, rollout config, the fleet
controller's handle and its constructor settings; see ``LLMServerClient.__reduce__``), and a Ray
worker actor that receives one (the trainer's ``get_llm_client()``, as in verl) holds a new client
of the same fleet with the same settings, built in the actor, which fetches the replicas from the
controller on first use and keeps them fresh. That client belongs to the worker's process, so the
worker closes it. Without a client, an actor builds one itself from the controller's handle
(``client_cls``, ``LLMServerClient`` by default). In-process use (tests, a single-process driver,
another framework's event loop) passes a ready client that the caller owns and closes.

Loops are built once per worker per name and reused (unless a loop class sets
``per_trajectory``); at most ``agent.max_concurrent_trajectories`` trajectories run at a time.
The reward of a trajectory is computed here, as soon as it finishes.

Logic lives in the plain class; :data:`AgentLoopWorkerActor` is the thin Ray actor around it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Mapping, Optional, Sequence

# The built-in loops register themselves on import.
import rollfleet.agent_loop.http_agent
import rollfleet.agent_loop.single_turn
import rollfleet.agent_loop.tool_agent  # noqa: F401
from rollfleet.agent_loop.base import AgentLoopBase, AgentLoopContext, AgentLoopOutput
from rollfleet.agent_loop.registry import get_agent_loop, load_agent_loop_config
from rollfleet.agent_loop.tools import ToolsLike, load_tools
from rollfleet.client import LLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.reward import compute_reward
from rollfleet.types import SamplingParams
from rollfleet.utils.aio import gather_or_cancel

logger = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer of a built-in model name or a model folder."""
    from transformers import AutoTokenizer

    from rollfleet.models import get_model_path

    return AutoTokenizer.from_pretrained(get_model_path(model))


def model_text(output: AgentLoopOutput, tokenizer: Any) -> str:
    """The model's own text in a trajectory (mask-1 spans, decoded one by one, joined by newlines),
    so that a number inside a tool result is never taken for the model's answer."""
    spans: list[list[int]] = []
    prev = 0
    for tok, m in zip(output.response_ids, output.response_mask):
        if m:
            if not prev:
                spans.append([])
            spans[-1].append(tok)
        prev = m
    return "\n".join(tokenizer.decode(s, skip_special_tokens=True) for s in spans)


def default_sampling_params(config: RollfleetConfig) -> SamplingParams:
    rollout = config.rollout
    return {
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "logprobs": rollout.calculate_log_probs,
    }


class AgentLoopWorker:
    """Runs samples through registered agent loops on one client.

    Args:
        config: the whole config tree (the worker reads ``rollout`` and ``agent``).
        client: a ready client; else ``controller`` is required.
        controller: the fleet controller's Ray handle; the worker builds ``client_cls`` on it.
        client_cls: client class to build (``FullyAsyncLLMServerClient`` for partial rollouts).
        owns_client: whether :meth:`close` closes the client. Default: only one built here; the
            Ray actor also owns a client it was given (it arrived pickled, so it is a copy that
            belongs to the actor's process).
        tokenizer: defaults to ``rollout.model``'s tokenizer.
        tools: tools or plain functions for tool-calling loops (plus ``multi_turn.tool_config_path``).
    """

    def __init__(
        self,
        config: RollfleetConfig,
        *,
        client: Any = None,
        controller: Any = None,
        client_cls: Optional[type] = None,
        client_kwargs: Optional[Mapping[str, Any]] = None,
        tokenizer: Any = None,
        tools: ToolsLike = None,
        owns_client: Optional[bool] = None,
    ) -> None:
        if isinstance(config, dict):
            config = RollfleetConfig.model_validate(config)
        self.config = config
        self._owns_client = client is None if owns_client is None else owns_client
        if client is None:
            if controller is None:
                raise ValueError("AgentLoopWorker needs a client or the fleet controller's handle")
            cls = client_cls or LLMServerClient
            client = cls(config.rollout, controller=controller, **dict(client_kwargs or {}))
        self.client = client
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.rollout.model)
        load_agent_loop_config(config.agent.agent_loop_config_path)
        self.context = AgentLoopContext(
            client=client,
            tokenizer=self.tokenizer,
            rollout=config.rollout,
            agent=config.agent,
            tools=load_tools(tools, config.agent.multi_turn.tool_config_path),
            gateway=config.gateway,
        )
        self.sampling_params = default_sampling_params(config)
        self._loops: dict[str, AgentLoopBase] = {}
        self._sem: Optional[asyncio.Semaphore] = None
        self.num_running = 0

    async def ready(self) -> dict[str, Any]:
        """Warm up the client's fleet view; returns facts the manager needs (pad id)."""
        fleet = getattr(self.client, "fleet", None)
        if fleet is not None:
            await fleet.ensure_started()
        pad = self.tokenizer.pad_token_id
        return {"pad_token_id": pad if pad is not None else (self.tokenizer.eos_token_id or 0)}

    def loop_for(self, name: str) -> AgentLoopBase:
        loop = self._loops.get(name)
        if loop is None:
            spec = get_agent_loop(name)
            cls = spec.resolve()
            loop = cls(self.context, **spec.kwargs)
            if not cls.per_trajectory:
                self._loops[name] = loop
        return loop

    async def run_sample(self, sample: Mapping[str, Any]) -> AgentLoopOutput:
        """Run one sample's loop and score it."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.agent.max_concurrent_trajectories)
        self.num_running += 1
        try:
            async with self._sem:
                sample = dict(sample)
                name = sample.pop("agent_name", None) or self.config.agent.default_agent_loop
                params = {**self.sampling_params, **(sample.pop("sampling_params", None) or {})}
                loop = self.loop_for(name)
                try:
                    output = await loop.run(params, **sample)
                finally:
                    if type(loop).per_trajectory:  # built for this trajectory alone: what it holds goes with it
                        await loop.close()
                self.score(output, sample)
                output.extra_fields.setdefault("agent_name", name)
                return output
        finally:
            self.num_running -= 1

    async def generate_sequences(self, samples: Sequence[Mapping[str, Any]]) -> list[AgentLoopOutput]:
        """Run a chunk of samples concurrently (bounded); outputs in sample order."""
        return await gather_or_cancel(self.run_sample(s) for s in samples)

    def score(self, output: AgentLoopOutput, sample: Mapping[str, Any]) -> None:
        """Compute the sample's verifiable reward unless the loop already set one."""
        if output.reward_score is not None:  # the loop's own (a NaN one is refused all the same)
            score, output.reward_score = output.reward_score, None
            self._scored(output, score)
            return
        spec = sample.get("reward")
        if spec is None and sample.get("reward_model") is not None:  # verl's dataset field
            spec = dict(sample["reward_model"])
            spec.pop("style", None)
        if spec is None and "ground_truth" in sample:
            spec = {"ground_truth": sample["ground_truth"]}
        if not spec:
            return
        if set(spec) == {"score"}:  # a reward given outright (plans, load tests): nothing to decode
            self._scored(output, float(spec["score"]))
            return
        start = time.perf_counter()
        try:
            result = compute_reward(model_text(output, self.tokenizer), spec, self.config.agent.default_reward)
        except Exception as exc:  # one sample's reward failing must not take its siblings or the step down
            logger.warning("reward of %s failed: %r", output.extra_fields.get("request_id", "a sample"), exc)
            output.extra_fields["reward_error"] = repr(exc)[:500]
            return  # unscored: left out of the loss (a step where every reward failed stops the run)
        finally:
            output.metrics.compute_score = time.perf_counter() - start
        if result is not None:
            self._scored(output, result.score)
            output.extra_fields["reward_extra_info"] = result.info

    @staticmethod
    def _scored(output: AgentLoopOutput, score: float) -> None:
        """Set the reward; NaN or an infinity leaves the sample unscored, as a reward that raised
        does: it would make its group's advantages, the loss and so the whole step NaN."""
        if math.isfinite(score):
            output.reward_score = score
            return
        logger.warning("reward of %s is %s: left unscored", output.extra_fields.get("request_id", "a sample"), score)
        output.extra_fields["reward_error"] = f"the reward is {score}, not a finite number"

    async def client_info(self) -> dict[str, Any]:
        """What client this worker routes through: its class (module-qualified), its
        ``partial_rollout`` when it has one, and whether this worker owns (closes) it."""
        client = self.client
        info: dict[str, Any] = {"class": f"{type(client).__module__}.{type(client).__qualname__}"}
        if hasattr(client, "partial_rollout"):
            info["partial_rollout"] = client.partial_rollout
        info["owns_client"] = self._owns_client
        return info

    async def close(self) -> None:
        for loop in self._loops.values():
            await loop.close()
        if self._owns_client:
            await self.client.close()


try:  # Ray is a hard dependency, but keep the plain class importable without it.
    import ray

    @ray.remote(num_cpus=0, max_concurrency=100_000)  # type: ignore[call-overload]  # Ray's stub omits actor options
    class AgentLoopWorkerActor(AgentLoopWorker):
        """Ray actor around :class:`AgentLoopWorker` (asyncio). Its client is its own: built in
        ``__init__``, or given, in which case it arrived pickled and was rebuilt in this process."""

        def __init__(self, config: RollfleetConfig, **kwargs: Any) -> None:
            if kwargs.get("client") is not None:
                kwargs.setdefault("owns_client", True)
            super().__init__(config, **kwargs)

except ImportError:  # pragma: no cover
    AgentLoopWorkerActor = None  # type: ignore[assignment,misc]


__all__ = ["AgentLoopWorker", "AgentLoopWorkerActor", "load_tokenizer", "model_text", "default_sampling_params"]
