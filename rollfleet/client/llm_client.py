"""``LLMServerClient``: the one way an agent loop (or the gateway) talks to the fleet.

``generate(request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput``. The
``request_id`` is the session key: every turn of one trajectory passes the same id and lands on
the same replica while that replica is healthy and not overloaded.

Compared with verl's client: routing is in-process (no actor round trip), acquire sits inside
``try`` and release in ``finally`` so cancellation never leaks a count, a caller's cancellation
also aborts the request on the replica, a replica that fails mid-request is quarantined and the
request re-routed under a bounded retry policy, and errors come back typed.

A client can be sent to another process (a Ray agent-loop worker, so that every trainer hands
its workers the client from ``Trainer.get_llm_client()``): it pickles as a recipe, not as state.
See :meth:`LLMServerClient.__reduce__`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional, Union

from rollfleet.client.dispatch import DISPATCH_ORDERS, DispatchGate
from rollfleet.client.fleet_view import FleetView
from rollfleet.client.prompt import checked_params, checked_prompt
from rollfleet.client.retry import RetryPolicy, is_replica_failure, is_retryable, unwrap
from rollfleet.client.streaming import stream_generate
from rollfleet.config import RollfleetConfig, RolloutConfig
from rollfleet.errors import NoServerAvailable, RetriesExhausted
from rollfleet.routing import GlobalRequestLoadBalancer
from rollfleet.types import ReplicaResponse, SamplingParams, TokenDelta, TokenOutput
from rollfleet.utils import virtual_time
from rollfleet.utils.refs import awaited, within

logger = logging.getLogger(__name__)

ConfigLike = Union[RolloutConfig, RollfleetConfig, dict, None]


def rollout_config_of(config: ConfigLike) -> RolloutConfig:
    """Accept the rollout section, the whole tree, a dict of either, or nothing (defaults)."""
    if config is None:
        return RolloutConfig()
    if isinstance(config, RolloutConfig):
        return config
    if isinstance(config, RollfleetConfig):
        return config.rollout
    if isinstance(config, dict):
        if "rollout" in config and isinstance(config["rollout"], (dict, RolloutConfig)):
            return RollfleetConfig.model_validate(config).rollout
        return RolloutConfig.model_validate(config)
    raise TypeError(f"config must be a RolloutConfig, RollfleetConfig or dict, got {type(config).__name__}")


class WeightsMoved(Exception):
    """A resume pinned to one weight version found its replica on another (or on one not known):
    the tokens so far must not be continued by other weights (``partial_rollout`` off)."""

    def __init__(self, request_id: str, wanted: int, found: Optional[int]) -> None:
        super().__init__(f"{request_id}: its tokens are version {wanted}'s, the replica serves {found}")


class LLMServerClient:
    """Routes generation requests to the fleet's replicas.

    Args:
        config: the rollout config (or the whole config tree).
        load_balancer_handle: a Ray actor handle of a shared ``GlobalRequestLoadBalancer`` (verl's
            deployment). When given, acquire/release go through it (slow, but compatible); when
            not, the client routes in-process (the default, and the fast path).
        servers: ``{replica_id: handle}`` to start from (the manager passes the fleet's).
        controller: the fleet controller's handle; the client refreshes its fleet view from it.
        balancer: a ready in-process balancer (per-process state: a pickled copy builds its own).
        retry_policy: defaults to one built from ``config.retry``.
        **kwargs: extra options, kept in ``extra_options``.

    The constructor arguments that define the client's settings (everything but ``config`` and
    ``controller``, which have their own attributes, and the per-process ``servers`` and
    ``balancer``) are recorded in :attr:`init_kwargs`; a subclass adds its own there.
    """

    def __init__(
        self,
        config: ConfigLike = None,
        load_balancer_handle: Any = None,
        *,
        servers: Optional[dict[str, Any]] = None,
        controller: Any = None,
        balancer: Optional[GlobalRequestLoadBalancer] = None,
        retry_policy: Optional[RetryPolicy] = None,
        **kwargs: Any,
    ) -> None:
        self.config = rollout_config_of(config)
        routing = self.config.routing
        self._remote_balancer = load_balancer_handle
        #: One seed for every random choice this client makes (routing ties, backoff jitter): a
        #: plan on virtual time repeats exactly only if both do.
        seed = self.config.seed if self.config.full_determinism else routing.seed
        self.balancer = balancer or GlobalRequestLoadBalancer(
            servers or {},
            max_cache_size=routing.max_cache_size,
            full_determinism=self.config.full_determinism,
            policy=routing.policy,
            sticky=routing.sticky,
            sticky_overload_factor=routing.sticky_overload_factor,
            sticky_overload_slack=routing.sticky_overload_slack,
            sticky_spill_kv_usage=routing.sticky_spill_kv_usage,
            seed=seed,
            max_inflight_per_replica=routing.max_inflight_per_replica,
            policy_options=routing.policy_options(),
        )
        #: Where requests wait while the balancer's dispatch limit holds them back (None: no limit).
        self._gate: Optional[DispatchGate] = None
        if self.balancer.dispatch_limit is not None:
            self._gate = DISPATCH_ORDERS[routing.dispatch_order](
                room=self.balancer.free_slots,
                limit=self.balancer.dispatch_limit,
                lookahead=routing.dispatch_lookahead,
            )
            self.balancer.hold_placed = self._gate.holds_placed
            self.balancer.on_room = self._gate.wake
        health = self.config.health
        self.fleet = FleetView(
            self.balancer,
            controller=controller,
            refresh_interval_s=routing.load_refresh_interval_s,
            quarantine_s=health.probe_interval_s * (health.failures_to_dead + 1),
        )
        self.retry = retry_policy or RetryPolicy(self.config.retry, seed=seed)
        self.extra_options = kwargs
        #: Acquires whose callers were cancelled mid-call, and their releases (:meth:`_acquire_remote`).
        self._orphans: set[asyncio.Future[Any]] = set()
        #: Constructor keyword arguments a copy in another process is rebuilt with (``__reduce__``).
        self.init_kwargs: dict[str, Any] = dict(kwargs)
        if load_balancer_handle is not None:
            self.init_kwargs["load_balancer_handle"] = load_balancer_handle
        if retry_policy is not None:
            self.init_kwargs["retry_policy"] = retry_policy

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as "a new client of the same fleet with the same settings".

        Agent-loop workers are separate processes (Ray actors), and the trainer hands them the
        client it got from the fleet. What a client holds in memory (the balancer's replica
        handles, in-flight counts and sticky sessions, the fleet view's refresher task bound to
        this process's event loop) means nothing in another process, so it is not sent: the
        receiving process rebuilds the same class with the same rollout config, controller handle
        and :attr:`init_kwargs` (e.g. ``partial_rollout``), and that client fetches the fleet from
        the controller on first use and keeps its own sessions and connections. Hence a client
        without a controller (built on a fixed ``servers`` dict) cannot be pickled: the copy
        would have no way to find the fleet.
        """
        controller = self.fleet.controller
        if controller is None:
            raise TypeError(
                f"cannot pickle a {type(self).__name__} built without a controller: a copy in another "
                "process finds the fleet through the controller's handle; build the client with "
                "controller= (LLMServerManager.get_client does) rather than a fixed servers dict"
            )
        return (_rebuild_client, (type(self), self.config, controller, dict(self.init_kwargs)))

    # ------------------------------------------------------------------ public API
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One attempt's worth of generation (re-routed on replica failure, never on bad input)."""
        return await self._generate(request_id, checked_prompt(prompt_ids), checked_params(sampling_params), kwargs)

    async def _generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams],
        kwargs: dict[str, Any],
        same_weights_as: Optional[int] = None,
    ) -> TokenOutput:
        """:meth:`generate` of a checked prompt (the resuming client sends its attempts here).
        ``same_weights_as``: send it only to a replica known to serve that weight version, else
        raise :class:`WeightsMoved` (a resume that must not mix two policies' tokens)."""
        await self.fleet.ensure_started()
        prompt_len = len(prompt_ids)
        attempt = 0
        no_server_waits = 0  # backoff of waits for a routable replica (they are not attempts)
        no_server_since: Optional[float] = None
        while True:
            attempt += 1
            try:
                response = await self._generate_once(
                    request_id, prompt_ids, sampling_params, prompt_len, kwargs, same_weights_as
                )
            except asyncio.CancelledError:
                raise
            except Exception as raw:
                exc = unwrap(raw)
                if not is_retryable(exc):
                    raise exc from (None if exc is raw else raw)
                if isinstance(exc, NoServerAvailable):
                    # The whole fleet is restarting or syncing: wait for it (bounded by time), and
                    # do not spend the attempts meant for failures of a replica.
                    now = virtual_time.now()
                    no_server_since = no_server_since or now
                    if now - no_server_since > self.config.retry.no_server_wait_s:
                        why = NoServerAvailable(
                            f"{exc.detail}; waited {now - no_server_since:.0f}s "
                            f"(retry.no_server_wait_s); {self.fleet.describe()}"
                        )
                        raise RetriesExhausted(request_id, attempt, why) from exc
                    attempt -= 1
                    no_server_waits += 1
                    backoff_step = no_server_waits
                elif attempt >= self.retry.max_attempts:
                    raise RetriesExhausted(request_id, attempt, exc) from exc
                else:
                    no_server_since = None
                    no_server_waits = 0
                    backoff_step = attempt
                logger.debug("request %s attempt %d failed (%r); retrying", request_id, attempt, exc)
                await self.retry.wait(max(backoff_step, 1))
                if self.fleet.controller is not None and not any(
                    self.balancer.is_routable(s) for s in self.balancer.get_all_servers()
                ):
                    try:  # shared by all waiting requests, and not more often than the backoff floor
                        await self.fleet.refresh_if_older(self.retry.config.initial_backoff_s)
                    except Exception:
                        pass
                continue
            output = response.output
            extra = output.extra_fields
            extra.setdefault("min_global_steps", extra.get("global_steps"))
            extra.setdefault("max_global_steps", extra.get("global_steps"))
            return output

    def generate_stream(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
        """:meth:`generate`, streamed: token deltas as they are sampled, then the whole output; a
        replica failure (or, resuming, an abort) mid-stream goes on elsewhere from the tokens
        received. See :mod:`rollfleet.client.streaming`."""
        return stream_generate(self, request_id, checked_prompt(prompt_ids), sampling_params, **kwargs)

    async def _generate_once(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams],
        prompt_len: int,
        kwargs: dict[str, Any],
        same_weights_as: Optional[int] = None,
    ) -> ReplicaResponse:
        server_id: Optional[str] = None
        handle: Any = None
        ended = False
        try:
            server_id, handle = await self._acquire(request_id, prompt_len, prompt_ids)
            if same_weights_as is not None and (serves := self.balancer.version_of(server_id)) != same_weights_as:
                raise WeightsMoved(request_id, same_weights_as, serves)
            ref = handle.generate_with_load.remote(
                request_id, prompt_ids, sampling_params, client_id=self.balancer.client_id, **kwargs
            )
            try:
                response = await within(ref, self.config.retry.request_timeout_s)  # frees the replica's slot too
            except Exception as raw:
                exc = unwrap(raw)
                if is_replica_failure(exc):
                    self.fleet.quarantine(server_id, repr(exc))
                    self.balancer.unstick(request_id)  # re-route the session
                raise
            self.balancer.report_load(response.load, handle)
            self.balancer.observe_output(server_id, request_id, response.output)
            ended = response.output.stop_reason != "aborted"
            return response
        finally:
            await self._release(server_id, prompt_len, request_id, ended, handle)

    async def _acquire(self, request_id: str, prompt_len: int, prompt_ids: list[int]) -> tuple[str, Any]:
        if self._remote_balancer is not None:
            return await self._acquire_remote(request_id)
        self.fleet.expire_quarantine()
        if self._gate is None:
            return self.balancer.acquire_server(request_id, prompt_len, prompt_ids)
        woken = False
        # asked only when someone waits: it hashes the prompt (a sibling of a placed prompt passes)
        may_try = self._gate.may_try(False) or self._gate.may_try(self.balancer.is_placed(request_id, prompt_ids))
        while True:
            if may_try or woken:
                acquired = self.balancer.try_acquire_server(request_id, prompt_len, prompt_ids)
                if acquired is not None:
                    if woken:
                        self._gate.dispatched(request_id, prompt_ids, acquired[0])
                    return acquired
            # a woken waiter that found no room keeps its place
            await self._gate.wait(front=woken, request_id=request_id, prompt_ids=prompt_ids)
            woken = True
            self.fleet.expire_quarantine()

    async def _acquire_remote(self, request_id: str) -> tuple[str, Any]:
        """Acquire through the shared balancer actor. A caller cancelled while the call is in
        flight does not undo it (the actor counts the request all the same), so the replica it
        picked is released as soon as the answer comes."""
        call = asyncio.ensure_future(awaited(self._remote_balancer.acquire_server.remote(request_id)))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._orphans.add(call)
            call.add_done_callback(self._orphans.discard)
            call.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, call: "asyncio.Future[tuple[str, Any]]") -> None:
        if call.cancelled() or call.exception() is not None:
            return  # nothing was counted
        server_id, _ = call.result()
        task = asyncio.ensure_future(self._release_remote(server_id))
        self._orphans.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._orphans.discard)

    async def _release_remote(self, server_id: str) -> None:
        """Uncount on the shared balancer actor. Awaited, unlike verl's fire-and-forget (counts must
        not drift), but never raised: the output is already in hand, and an error here would
        regenerate it. A call that fails went to an actor that is gone, and its counts with it."""
        try:
            await self._remote_balancer.release_server.remote(server_id)
        except Exception as exc:
            logger.warning("release of %s on the shared load balancer failed: %r", server_id, exc)

    async def _release(
        self, server_id: Optional[str], prompt_len: int, request_id: str, ended: bool, handle: Any = None
    ) -> None:
        """Uncount an attempt (``server_id`` None: it never got a replica; only the gate hears;
        ``ended``: it returned an output that was not aborted; ``handle``: the one its acquire
        returned, which tells the replica it went to from one re-added under its id since)."""
        if self._gate is not None:
            self._gate.finished(request_id, ended)
        if server_id is None:
            return
        if self._remote_balancer is not None:
            await self._release_remote(server_id)  # verl's signature: the id only
            return
        self.balancer.release_server(server_id, prompt_len, handle)

    def finish_session(self, request_id: str) -> None:
        """Call when a trajectory is done: frees its sticky entry (the prefix cache stays warm)."""
        self.balancer.finish_session(request_id)

    def get_status(self) -> dict[str, Any]:
        return self.balancer.get_status()

    async def close(self) -> None:
        await self.fleet.close()


def _rebuild_client(
    cls: type[LLMServerClient], config: RolloutConfig, controller: Any, init_kwargs: dict[str, Any]
) -> LLMServerClient:
    """Unpickle a client (see :meth:`LLMServerClient.__reduce__`): a fresh one, same settings."""
    return cls(config, controller=controller, **init_kwargs)


__all__ = ["LLMServerClient", "WeightsMoved", "rollout_config_of"]
