"""Typed errors that users of the fleet catch.

Recoverable errors (the request may succeed elsewhere or later) are kept apart from errors that
are the caller's fault (retrying the same input never helps) and from fatal ones. Nothing in
rollfleet matches on message text; callers branch on the type.

Every error pickles with its fields intact so it survives a Ray actor boundary: Ray re-raises an
actor's exception as a subclass of the original type, built from ``__reduce__``.
"""

from __future__ import annotations

from typing import Any


class RollfleetError(Exception):
    """Base of every error rollfleet raises on purpose."""

    #: True when the same request may succeed if tried again (elsewhere or later).
    retryable: bool = False


class InvalidRequest(RollfleetError, ValueError):
    """The caller's input breaks a limit. Never retried: the same input fails everywhere.

    ``field`` names the offending field (``prompt_ids``, ``sampling_params.max_tokens``...),
    ``limit`` states the bound that was broken and ``value`` what was given.
    """

    def __init__(self, field: str, limit: str, value: Any = None, detail: str = "") -> None:
        self.field = field
        self.limit = limit
        self.value = value
        self.detail = detail
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = f"invalid request: field '{field}' must satisfy {limit} (got {shown})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def __reduce__(self):  # keep the fields across pickling (Ray, multiprocessing)
        return (type(self), (self.field, self.limit, self.value, self.detail))


class NoServerAvailable(RollfleetError, RuntimeError):
    """No replica can take the request right now (empty pool, all dead or all syncing).

    The message starts with verl's text so that code written against verl keeps working.
    """

    retryable = True

    def __init__(self, detail: str = "") -> None:
        self.detail = detail
        msg = "No available servers in load balancer"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.detail,))


class ReplicaUnavailable(RollfleetError, RuntimeError):
    """One replica cannot serve (dead, hung, stopping, not yet on the current weights).

    The client marks the replica suspect and re-routes; the request is not lost.
    """

    retryable = True

    def __init__(self, replica_id: str, reason: str) -> None:
        self.replica_id = replica_id
        self.reason = reason
        super().__init__(f"replica {replica_id} unavailable: {reason}")

    def __reduce__(self):
        return (type(self), (self.replica_id, self.reason))


class EngineDead(ReplicaUnavailable):
    """The engine process behind a replica has died; the replica must be restarted."""


class NotSupported(RollfleetError, NotImplementedError):
    """An engine truly cannot perform an op of the engine interface."""

    def __init__(self, engine: str, op: str, reason: str = "") -> None:
        self.engine = engine
        self.op = op
        self.reason = reason
        msg = f"engine '{engine}' does not support '{op}'"
        if reason:
            msg += f": {reason}"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.engine, self.op, self.reason))


class InsufficientResources(RollfleetError, RuntimeError):
    """The cluster cannot hold what the configuration asks for (devices, nodes, labels).

    ``field`` names the setting that asked (``rollout.num_replicas``...), ``requested`` what it
    asked for and ``available`` what the cluster has, so the fix is obvious from the message.
    """

    def __init__(self, field: str, requested: str, available: str, detail: str = "") -> None:
        self.field = field
        self.requested = requested
        self.available = available
        self.detail = detail
        msg = f"'{field}' asks for {requested}, but the cluster has {available}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.field, self.requested, self.available, self.detail))


class CannotListen(RollfleetError, OSError):
    """A listener cannot bind the address its settings give (the port is taken, or the host is not
    this machine's). ``field`` names the setting to change (``gateway.port``, ``gateway.host``)."""

    def __init__(self, field: str, address: str, reason: str) -> None:
        self.field = field
        self.address = address
        self.reason = reason
        super().__init__(f"'{field}': cannot listen on {address}: {reason}")

    def __reduce__(self):
        return (type(self), (self.field, self.address, self.reason))


class FleetOperationFailed(RollfleetError, RuntimeError):
    """A control operation fanned out to the fleet failed on some replicas.

    ``failures`` maps each failed replica id to its error's text; the replicas not named
    succeeded.
    """

    def __init__(self, op: str, failures: dict[str, str]) -> None:
        self.op = op
        self.failures = dict(failures)
        first = next(iter(self.failures.items()), ("?", ""))
        super().__init__(f"{op} failed on {sorted(self.failures)}: {first[0]}: {first[1]}")

    def __reduce__(self):
        return (type(self), (self.op, self.failures))


class FleetShutDown(RollfleetError, RuntimeError):
    """The fleet was shut down: it starts no replica any more (``op`` was asked of it after)."""

    def __init__(self, op: str) -> None:
        self.op = op
        super().__init__(f"{op}: the fleet is shut down")

    def __reduce__(self):
        return (type(self), (self.op,))


class RetriesExhausted(RollfleetError, RuntimeError):
    """The client's bounded retry policy gave up; ``last_error`` is the final cause."""

    def __init__(self, request_id: str, attempts: int, last_error: BaseException | None) -> None:
        self.request_id = request_id
        self.attempts = attempts
        self.last_error = last_error
        super().__init__(f"request {request_id} failed after {attempts} attempts: {last_error!r}")

    def __reduce__(self):
        return (type(self), (self.request_id, self.attempts, self.last_error))


class UnknownName(RollfleetError, KeyError, ValueError):
    """A name that no registry of its plug-in family holds (``rollout.name: vlm``...).

    Both a ``KeyError`` (a failed lookup, what the agent-loop, reward and tool-parser registries
    raised) and a ``ValueError`` (a bad value, what the engine, policy, trainer and estimator
    registries raised, and what pydantic turns into a ``ValidationError`` naming the field when a
    config validator raises it). ``family`` is the plug-in family, ``valid`` the registered names.
    """

    def __init__(self, family: str, name: str, valid: "tuple[str, ...] | list[str]" = (), hint: str = "") -> None:
        self.family = family
        self.name = name
        self.valid = tuple(valid)
        self.hint = hint
        msg = f"unknown {family} '{name}'; valid names: {list(self.valid)}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would show the message quoted, as a key
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return (type(self), (self.family, self.name, self.valid, self.hint))


class AlreadyRegistered(RollfleetError, ValueError):
    """A name registered twice with different targets (the same target again is a no-op)."""

    def __init__(self, family: str, name: str, existing: str, new: str) -> None:
        self.family = family
        self.name = name
        self.existing = existing
        self.new = new
        super().__init__(f"{family} '{name}' is already registered as {existing}; cannot register {new}")

    def __reduce__(self):
        return (type(self), (self.family, self.name, self.existing, self.new))


class InvalidPlugin(RollfleetError, TypeError):
    """A registered target is not what its family needs (not a subclass of ``Engine``, not callable...)."""

    def __init__(self, family: str, name: str, target: str, expected: str) -> None:
        self.family = family
        self.name = name
        self.target = target
        self.expected = expected
        super().__init__(f"{family} '{name}': {target} is not {expected}")

    def __reduce__(self):
        return (type(self), (self.family, self.name, self.target, self.expected))


__all__ = [
    "RollfleetError",
    "InvalidRequest",
    "NoServerAvailable",
    "ReplicaUnavailable",
    "EngineDead",
    "NotSupported",
    "InsufficientResources",
    "CannotListen",
    "FleetOperationFailed",
    "FleetShutDown",
    "RetriesExhausted",
    "UnknownName",
    "AlreadyRegistered",
    "InvalidPlugin",
]
