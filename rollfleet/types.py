"""Records that cross every layer: generation output, replica load, sampling parameters.

This module holds data only, no I/O, so that every layer (engines up to trainers) can import it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

#: The one vocabulary of finish reasons, for every engine.
#: ``stop``: the model ended the response (EOS or a stop token/string);
#: ``length``: the token budget (``max_tokens``, or the trajectory budget for resumed requests) ran out;
#: ``aborted``: the request was interrupted (weight update, abort_all, replica stopping) and may be resumed
#: from the tokens it returned.
StopReason = Literal["stop", "length", "aborted"]
STOP_REASONS: tuple[str, ...] = ("stop", "length", "aborted")

#: Sampling parameters travel as a plain dict (as in verl) so any engine-specific key passes through.
SamplingParams = dict[str, Any]

#: Keys that name the per-request token budget, in order of precedence.
BUDGET_KEYS: tuple[str, ...] = ("max_tokens", "max_new_tokens")


class TokenOutput(BaseModel):
    """The result of one generation (one attempt, or a whole resumed request).

    ``extra_fields`` always carries ``global_steps`` (weight version the last attempt finished
    under), ``min_global_steps`` (version of the first token) and ``max_global_steps`` (version of
    the last token) once the output has passed through a replica.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    stop_reason: StopReason = "stop"
    num_preempted: int = 0
    #: Weight version of every token, when known (same length as ``token_ids``). From an engine,
    #: None marks tokens of the weights it booted with (the replica knows which version that is);
    #: a replica's output has no None left.
    token_versions: Optional[list[Optional[int]]] = None
    extra_fields: dict[str, Any] = Field(default_factory=dict)


@dataclass(slots=True)
class TokenDelta:
    """New tokens of a generation still running (streaming): their ids, logprobs and the weight
    version that sampled each (None: the engine's boot weights; an empty list: not known yet, as
    vLLM names them only at the end). The whole :class:`TokenOutput` that ends a stream is the
    authority; deltas are for showing tokens early."""

    token_ids: list[int]
    log_probs: list[float]
    token_versions: list[Optional[int]]


@dataclass(slots=True)
class LoadReport:
    """What a replica says about itself: piggybacked on every response and polled.

    ``inflight`` and ``inflight_tokens`` are counted by the replica itself (requests inside it and
    the prompt tokens they carry), the same way a client counts its own. ``by_client`` splits them
    by the client that sent them (``client_id -> (requests, tokens)``; a client absent had none in
    flight), so a client's router learns the load of everyone else *at the moment the replica
    counted*: ``others = inflight - by_client[me]``. Subtracting its count *now* instead would turn
    the client's own requests that finished since into phantom load of others, and a report that
    is a second old (a polled one) would steer new sticky sessions away from a replica that is in
    fact idle. A report on a response carries the requester's entry only; one polled for a client
    carries that client's. ``running``, ``waiting`` and ``kv_usage`` come from the engine's own
    view, refreshed when the replica is polled.
    """

    replica_id: str
    inflight: int = 0
    inflight_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    weight_version: Optional[int] = None
    #: ``serving`` | ``paused`` | ``sleeping`` | ``starting`` | ``stopped``
    state: str = "serving"
    timestamp: float = field(default_factory=time.monotonic)
    by_client: Optional[dict[str, tuple[int, int]]] = None

    def for_client(self, client_id: Optional[str]) -> "LoadReport":
        """This report with ``client_id``'s share alone in ``by_client`` (no split without one)."""
        if self.by_client is None:
            return self
        share = None if client_id is None else {client_id: self.by_client.get(client_id, (0, 0))}
        return dataclasses.replace(self, by_client=share)


@dataclass(slots=True)
class ReplicaResponse:
    """A replica's answer on the data plane: the output plus the replica's load at that moment."""

    output: TokenOutput
    load: LoadReport


def budget_of(sampling_params: SamplingParams) -> Optional[int]:
    """The token budget a request asks for, from the first budget key present, else None."""
    for key in BUDGET_KEYS:
        value = sampling_params.get(key)
        if value is not None:
            return value
    return None


__all__ = [
    "StopReason",
    "STOP_REASONS",
    "SamplingParams",
    "BUDGET_KEYS",
    "TokenOutput",
    "TokenDelta",
    "LoadReport",
    "ReplicaResponse",
    "budget_of",
]
