"""The engine interface: what one inference engine behind one replica must offer.

Every engine (``vllm``, ``sglang``, ``sim``) implements all of it. An op an engine truly cannot
perform raises :class:`rollfleet.errors.NotSupported` naming the engine and the op, rather than
silently doing nothing, so callers can decide (e.g. the manager skips ``sleep`` on such engines).

Engines know nothing of routing or validation: the replica (``rollfleet.server``) checks input
before it reaches the engine. Of weight versions they know only what a two-phase update tells
them (:meth:`Engine.stage_weights`, :meth:`Engine.commit_weights`): an engine that can keep its
in-flight requests across an update (``"keep"`` in :attr:`Engine.update_modes`) stamps each token
with the version that sampled it, since only it knows where in a response the weights changed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, AsyncIterator, ClassVar, Literal, Optional, Union

from rollfleet.errors import NotSupported
from rollfleet.types import SamplingParams, TokenDelta, TokenOutput

#: How a commit treats the requests in flight: ``abort`` ends them (they return their partial
#: tokens, and the client resumes them on the new weights); ``keep`` freezes them with their KV
#: cache and lets them continue on the new weights (no resubmission, no re-prefill).
CommitMode = Literal["abort", "keep"]


@dataclass(slots=True)
class EngineLoad:
    """An engine's own view of its load."""

    running: int = 0
    waiting: int = 0
    inflight_tokens: int = 0
    kv_usage: float = 0.0


@dataclass(slots=True)
class EngineLimits:
    """Input limits the replica validates against before a request reaches the engine."""

    vocab_size: int
    max_model_len: int


#: An output's ``extra_fields`` key: an engine that cannot label its tokens' weights and knows a
#: weight load may have happened under the request (it outlived a pause) says so, and the replica
#: labels the tokens unknown instead of with the version the request started on.
VERSIONS_UNKNOWN = "versions_unknown"


@dataclass(slots=True)
class EngineHealth:
    healthy: bool
    detail: str = ""


class Engine(abc.ABC):
    """Async interface of one inference engine (one replica's worth of GPUs)."""

    #: Registry name, e.g. ``"vllm"``; used in NotSupported messages.
    name: ClassVar[str] = "engine"
    #: Address the engine's servers listen on: the node's IP on a cluster, loopback embedded.
    bind_host: str = "127.0.0.1"
    #: Accelerator ids this engine owns (as Ray assigned them); None: whatever the process sees.
    devices: Optional[list[str]] = None
    #: The Unix socket its server listens on, private to this user on its node; None: no such socket.
    socket_path: Optional[str] = None

    #: The commit modes :meth:`commit_weights` accepts. Every engine can ``abort``.
    update_modes: ClassVar[frozenset[str]] = frozenset({"abort"})
    #: Whether :meth:`generate_stream` yields tokens as they are sampled (else the output at the end).
    streams: ClassVar[bool] = False
    #: The options :meth:`start_profile` takes; the replica refuses any other, naming it. None:
    #: the engine's server checks them itself.
    profile_options: ClassVar[Optional[frozenset[str]]] = None

    def assign(self, host: str, devices: Optional[list[str]] = None) -> None:
        """Where the engine runs, decided by placement before :meth:`start`: it listens on ``host``
        only (never on every interface) and uses exactly ``devices``."""
        self.bind_host = host
        self.devices = list(devices) if devices is not None else None

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the engine up; return when it can serve. Raise with a clear reason otherwise."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and every process it owns. Idempotent."""

    @abc.abstractmethod
    def limits(self) -> EngineLimits:
        """Vocabulary size and context length, known once ``start`` has returned."""

    def address(self) -> str:
        """Where the engine can be reached from outside (URL), or a pseudo-address."""
        return f"{self.name}://local"

    @abc.abstractmethod
    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        """Generate one response. ``sampling_params`` always holds ``max_tokens``.

        An interrupted request returns ``stop_reason="aborted"`` with the tokens generated so far.
        ``kwargs`` are per-request extras forwarded by the client (e.g. ``priority``); an engine
        uses those it understands and ignores ``None`` values.
        """

    async def generate_stream(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
        """:meth:`generate`, yielding :class:`TokenDelta` s as tokens are sampled, then the whole
        output (the authority: deltas are only for showing tokens early). Closing the iterator
        early aborts the request. This default, for engines that cannot stream (``streams`` is
        False), yields the whole output alone."""
        yield await self.generate(request_id, prompt_ids, sampling_params, **kwargs)

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort one request; it returns ``aborted`` with its partial tokens. Unknown ids are ignored."""

    @abc.abstractmethod
    async def abort_all(self) -> int:
        """Abort every in-flight request; return how many were aborted."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Abort in-flight requests and hold new ones until :meth:`resume` (partial rollout)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Serve again after :meth:`pause` or :meth:`wake_up`."""

    @abc.abstractmethod
    async def sleep(self) -> None:
        """Free accelerator memory (weights and KV cache) while idle."""

    @abc.abstractmethod
    async def wake_up(self) -> None:
        """Re-acquire the memory freed by :meth:`sleep`."""

    @abc.abstractmethod
    async def update_weights(self, weights: Any) -> None:
        """Load new weights (a state dict, a path, or an engine-specific spec) at once."""

    async def stage_weights(self, weights: Any, version: int) -> None:
        """Phase 1 of an update, while the engine keeps generating: bring ``weights`` (a state
        dict or a path) to where :meth:`commit_weights` loads them from quickly. Staging a newer
        version drops older staged ones. Default: hold them in this process's memory."""
        staged = self.__dict__.setdefault("_staged_weights", {})
        staged.clear()
        staged[version] = weights

    async def commit_weights(self, version: int, mode: CommitMode = "abort") -> None:
        """Phase 2: load the weights staged under ``version``.

        ``abort``: the caller has paused the engine (its in-flight requests came back aborted) and
        resumes it afterwards. ``keep`` (engines listing it in :attr:`update_modes`): the engine
        freezes its in-flight requests itself, loads, labels what it samples from now on with
        ``version``, and lets them continue. Default: ``abort`` through :meth:`update_weights`.
        """
        if mode not in self.update_modes:
            raise NotSupported(self.name, f"commit_weights(mode={mode!r})", f"modes: {sorted(self.update_modes)}")
        staged = self.__dict__.get("_staged_weights", {})
        if version not in staged:
            raise KeyError(f"no weights staged under version {version} (staged: {sorted(staged)})")
        await self.update_weights(staged.pop(version))

    async def weights_checksum(self) -> Optional[str]:
        """A digest of the weights the engine serves with, equal on two engines exactly when their
        weights are (as far as the engine can see them); None when the engine cannot tell. After
        a commit the fleet compares them, and restarts a replica that disagrees."""
        return None

    def drop_staged(self) -> None:
        """Forget staged weights (an update was given up, or the engine restarts)."""
        self.__dict__.pop("_staged_weights", None)

    @abc.abstractmethod
    async def clear_kv_cache(self) -> None:
        """Drop the prefix cache (after a weight update, cached KV is stale)."""

    @abc.abstractmethod
    async def start_profile(self, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    async def stop_profile(self) -> Optional[str]:
        """Stop profiling; return where the trace was written, if anywhere."""

    @abc.abstractmethod
    async def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    async def load(self) -> EngineLoad: ...

    def stats(self) -> dict[str, float]:
        """Cumulative counters worth reporting (prefix-cache hits, preemptions...); may be empty."""
        return {}


def replica_seed(seed: int, replica_index: int) -> int:
    """The seed a replica's server starts with: the fleet's, offset by the replica's index. One
    seed for all made replicas that saw the same batches draw the same sampling noise (an
    unseeded request samples from the server's global generator), so a GRPO group spread over
    them got identical completions, and an advantage of 0."""
    return seed + replica_index
