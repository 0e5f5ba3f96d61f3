"""Contracts of the agent-loop layer: what a loop gets, what it returns.

A loop is built **once per worker** and reused by every trajectory that worker runs (verl builds
one per trajectory through hydra, which costs an instantiation per sample and invites state
leaking between trajectories anyway). Per-trajectory state therefore lives in ``run``'s locals. A
loop that truly needs per-trajectory instance state sets ``per_trajectory = True`` and the worker
builds a fresh instance for each trajectory, and closes it when the trajectory ends.

Everything a loop needs arrives in one :class:`AgentLoopContext`: the client (the only way to the
fleet), the tokenizer, the rollout and agent config sections, and the tools. Loops never see the
manager or Ray.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, Optional

from rollfleet.agent_loop.chat import ChatRenderer
from rollfleet.client.budget import MIN_KEYS, token_budget
from rollfleet.config import AgentConfig, GatewayConfig, RolloutConfig
from rollfleet.errors import InvalidRequest
from rollfleet.types import BUDGET_KEYS, SamplingParams, TokenOutput
from rollfleet.utils import lists
from rollfleet.utils.ids import unique_hex


@dataclass(slots=True)
class AgentLoopMetrics:
    """Per-trajectory timings (seconds) and counters; verl's names where verl has one."""

    generate_sequences: float = 0.0  #: time spent waiting on ``client.generate``
    tool_calls: float = 0.0  #: time spent running tools (wall, concurrent calls counted once)
    compute_score: float = 0.0  #: time spent computing the reward
    num_preempted: int = 0  #: KV preemptions of this trajectory's requests on the engines
    num_resumes: int = 0  #: abort -> resume cycles (weight updates mid-turn; FullyAsync client)
    num_generate_calls: int = 0
    num_tool_calls: int = 0

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class AgentLoopOutput:
    """One finished trajectory, unpadded.

    ``response_ids`` holds every token after the prompt: the model's (``response_mask`` 1) and
    those the loop inserted (tool results, user turns, chat-template boundaries: mask 0).
    ``response_logprobs`` is aligned with ``response_ids`` (0.0 where the mask is 0), or None
    when logprobs were not asked for. ``response_versions``, aligned with ``response_ids`` too,
    is the weight version that sampled each model token (-1 where unknown and on inserted
    tokens), or None when the fleet did not say. ``extra_fields`` always holds
    ``min_global_steps`` and ``max_global_steps`` (weight versions of the trajectory's first and
    last model token), ``turn_scores`` and ``tool_rewards``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: Optional[list[float]] = None
    num_turns: int = 0
    reward_score: Optional[float] = None
    metrics: AgentLoopMetrics = field(default_factory=AgentLoopMetrics)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    response_versions: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if len(self.response_mask) != len(self.response_ids):
            raise ValueError(
                f"response_mask has {len(self.response_mask)} entries for {len(self.response_ids)} response tokens"
            )
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries for {len(self.response_ids)} tokens"
            )
        if self.response_versions is not None and len(self.response_versions) != len(self.response_ids):
            raise ValueError(
                f"response_versions has {len(self.response_versions)} entries for {len(self.response_ids)} tokens"
            )
        for key, default in (
            ("turn_scores", []),
            ("tool_rewards", []),
            ("min_global_steps", None),
            ("max_global_steps", None),
        ):
            self.extra_fields.setdefault(key, default)


def token_versions_of(out: Any, n: int) -> Optional[list[int]]:
    """The versions of the first ``n`` tokens of a ``TokenOutput`` (-1 where unknown), or None."""
    versions = getattr(out, "token_versions", None)
    if versions is None or len(versions) < n:
        return None
    return lists.versions(versions[:n], unknown=-1)


@dataclass
class AgentLoopContext:
    """What a worker hands every loop it builds."""

    client: Any  #: an ``LLMServerClient`` (or anything with its ``generate`` / ``finish_session``)
    tokenizer: Any  #: a Hugging Face tokenizer with a chat template
    rollout: RolloutConfig
    agent: AgentConfig
    tools: Mapping[str, Any] = field(default_factory=dict)  #: name -> ``BaseTool``
    #: The config's ``gateway`` section: loops that serve a gateway of their own (``http_agent``)
    #: take its settings (tool-call parser, model name, session bounds) from it.
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


class AgentLoopBase(ABC):
    """Base of every agent loop. Subclasses implement :meth:`run` and register with ``@register``."""

    #: True when an instance holds per-trajectory state: the worker then builds one per trajectory.
    per_trajectory: ClassVar[bool] = False

    def __init__(self, context: AgentLoopContext, **kwargs: Any) -> None:
        self.context = context
        self.client = context.client
        self.tokenizer = context.tokenizer
        self.rollout = context.rollout
        self.agent = context.agent
        self.prompt_length = context.rollout.prompt_length
        self.response_length = context.rollout.response_length
        self.options = kwargs  #: extra constructor arguments from the loop's YAML entry
        self.chat = ChatRenderer(context.tokenizer)

    @abstractmethod
    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        """Run one trajectory for ``sample`` (``raw_prompt`` messages or ``prompt_ids``, plus
        whatever else the dataset carries) and return it unpadded."""

    async def close(self) -> None:
        """Release what the loop holds beyond one trajectory (a server it started); the worker
        calls it once, when it closes (a ``per_trajectory`` loop's: when its trajectory ends)."""

    # ------------------------------------------------------------------ helpers for subclasses
    def request_id_for(self, sample: Mapping[str, Any]) -> str:
        """The session key of a trajectory: the sample's ``request_id``, else a fresh id."""
        return str(sample.get("request_id") or unique_hex())

    def prompt_ids_of(self, sample: Mapping[str, Any], tools: Optional[list[dict]] = None) -> tuple[list[int], bool]:
        """The prompt's token ids (``prompt_ids`` as given, else ``raw_prompt`` rendered with the chat
        template and ``tools``), left-truncated to ``prompt_length`` as verl does (the end of a
        prompt holds the question and the generation prompt). Returns (ids, truncated)."""
        if sample.get("prompt_ids") is not None:
            ids = _token_ids(sample["prompt_ids"])
        elif sample.get("raw_prompt") is not None:
            ids = self.chat.prompt_ids(_messages(sample["raw_prompt"]), tools)
        else:
            raise InvalidRequest("raw_prompt", "chat messages, or 'prompt_ids' (a sample needs one of them)", None)
        if len(ids) > self.prompt_length:
            return ids[-self.prompt_length :], True
        return ids, False

    def budget_of(self, sampling_params: SamplingParams) -> int:
        """The trajectory's response budget: ``response_length``, or less where the sample's own
        ``sampling_params`` ask for less (``max_tokens`` or ``max_new_tokens``; a pair that differs
        is refused naming it). Each turn's request then carries what is left under ``max_tokens``."""
        return min(token_budget(sampling_params, self.response_length)[1], self.response_length)

    @staticmethod
    def turn_params(sampling_params: SamplingParams, max_tokens: int) -> SamplingParams:
        """One turn's sampling parameters: the sample's, with ``max_tokens`` the turn's room (the
        trajectory's budget keys dropped: a ``max_new_tokens`` kept beside it would differ) and a
        minimum (``min_tokens``) no higher than that room."""
        params = {k: v for k, v in sampling_params.items() if k not in BUDGET_KEYS}
        params["max_tokens"] = max_tokens
        for key in MIN_KEYS:  # a minimum over the turn's room was refused (min_tokens <= max_tokens):
            floor = params.get(key)  # the trajectory failed, and its batch with it
            if isinstance(floor, int) and not isinstance(floor, bool) and floor > max_tokens:
                params[key] = max_tokens
        return params

    def room_for(self, context_len: int, budget_left: int) -> int:
        """The most tokens the next request may ask for: the trajectory's remaining budget, capped
        by what still fits in the model's context (the server rejects anything longer)."""
        max_model_len = self.rollout.max_model_len or (self.prompt_length + self.response_length)
        return max(0, min(budget_left, max_model_len - context_len))


def _token_ids(value: Any) -> list[int]:
    """A sample's ``prompt_ids`` as ints; a string (its digits read one by one) or an empty list
    is refused naming the field, as is anything that is not a list of integers."""
    if isinstance(value, (str, bytes)):
        raise InvalidRequest("prompt_ids", "a list of token ids, not a string", value)
    try:
        ids = lists.ints(value)
    except (TypeError, ValueError):
        raise InvalidRequest("prompt_ids", "a list of integer token ids", value) from None
    if not ids:
        raise InvalidRequest("prompt_ids", "at least 1 token", ids)
    return ids


def _messages(value: Any) -> list[dict[str, Any]]:
    """A sample's ``raw_prompt`` as chat messages, or an error naming the field (a plain string,
    a common dataset mistake, failed deep in the template with an error about dictionaries)."""
    expected = "a list of chat messages ({'role': ..., 'content': ...})"
    if isinstance(value, (str, bytes, Mapping)):
        raise InvalidRequest("raw_prompt", expected, value)
    try:
        messages = list(value)  # a list, or a dataset's array of them
    except TypeError:
        raise InvalidRequest("raw_prompt", expected, value) from None
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"raw_prompt[{i}]", "a chat message with a 'role' string", message)
    return [dict(m) for m in messages]


def versions_of(outputs: list[TokenOutput]) -> tuple[Optional[int], Optional[int]]:
    """Weight versions of a trajectory's first and last model token (over all its generations);
    for a trajectory without tokens, the version its generations finished under."""
    with_tokens = [o.extra_fields for o in outputs if o.token_ids]
    lows: list[int] = [f["min_global_steps"] for f in with_tokens if f.get("min_global_steps") is not None]
    highs: list[int] = [f["max_global_steps"] for f in with_tokens if f.get("max_global_steps") is not None]
    if not lows or not highs:
        finals: list[int] = [
            o.extra_fields["global_steps"] for o in outputs if o.extra_fields.get("global_steps") is not None
        ]
        return (min(finals), max(finals)) if finals else (None, None)
    return min(lows), max(highs)


__all__ = ["AgentLoopMetrics", "AgentLoopOutput", "AgentLoopContext", "AgentLoopBase", "versions_of"]
