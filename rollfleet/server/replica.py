"""One replica: an engine behind input validation, version stamping and load reporting.

The logic lives in the plain class :class:`Replica` so it can be tested without Ray;
:data:`~rollfleet.server.actor.ReplicaActor` is the thin Ray actor around it (an asyncio actor, so
thousands of requests interleave in one process, as the engines expect). How outputs are labelled
with weight versions, and why here: :mod:`rollfleet.server.attempts`; its pause, sleep and weight
phases: :mod:`rollfleet.server.turns`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Optional, Union, cast

from rollfleet.config import RolloutConfig
from rollfleet.engines import Engine, EngineLimits, build_engine
from rollfleet.errors import InvalidRequest, NotSupported, ReplicaUnavailable
from rollfleet.health import ReplicaState
from rollfleet.server.attempts import Attempt, aborted_before_start, stamp_versions
from rollfleet.server.inflight import InflightBook
from rollfleet.server.liveness import EngineLiveness
from rollfleet.server.turns import HOLDING_STATES, ReplicaTurns
from rollfleet.server.validation import validate_profile_options, validate_prompt, validate_sampling_params
from rollfleet.types import LoadReport, ReplicaResponse, SamplingParams, TokenDelta, TokenOutput
from rollfleet.utils.ids import unique_hex

if TYPE_CHECKING:
    from rollfleet.server.dataplane import DataPlaneServer


class Replica(ReplicaTurns):
    """A single inference replica (engine + validation + versions + load)."""

    def __init__(
        self,
        replica_id: str,
        config: RolloutConfig,
        replica_index: int = 0,
        engine: Optional[Engine] = None,
    ) -> None:
        self.replica_id = replica_id
        self.replica_index = replica_index
        self.config = config
        self.engine = engine if engine is not None else build_engine(config, replica_index)
        self._state = ReplicaState.STARTING
        self._version: Optional[int] = None
        self._epoch = 0
        self._gate: Optional[asyncio.Event] = None
        self._book = InflightBook()
        health = config.health
        self._liveness = EngineLiveness(replica_id, self.engine, health.probe_timeout_s, health.busy_grace_s)
        self._limits: Optional[EngineLimits] = None  # known once the engine has started
        self._data_plane: Optional["DataPlaneServer"] = None
        self._counters = {"requests": 0, "invalid": 0, "aborted": 0, "errors": 0, "tokens_out": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(
        self, version: Optional[int] = None, *, host: str = "127.0.0.1", devices: Optional[list[str]] = None
    ) -> dict[str, Any]:
        """Start the engine on ``host`` with ``devices`` (placement's choice). With ``version``, the
        engine's boot weights are that version and the replica serves at once; without it, it waits
        for :meth:`update_weights` (state ``syncing``)."""
        self._gate = asyncio.Event()
        self.engine.assign(host, devices)
        await self.engine.start()
        self._limits = self.engine.limits()
        if version is not None:
            self._version = version
            self._set_state(ReplicaState.SERVING)
        else:
            self._set_state(ReplicaState.SYNCING)
        return self.info()

    async def shutdown(self) -> None:
        self._set_state(ReplicaState.STOPPED)
        if self._data_plane is not None:
            await self._data_plane.close()
        await self.engine.shutdown()

    async def serve_data_plane(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen for generate requests on ``host:port`` (see :mod:`rollfleet.server.dataplane`);
        return the address clients connect to."""
        from rollfleet.server.dataplane import DataPlaneServer

        if self._data_plane is None:
            self._data_plane = DataPlaneServer(
                self, host, port, port_range=self.config.data_plane_ports, allow_pickle=self.config.data_plane_pickle
            )
            await self._data_plane.start()
        return self._data_plane.address

    def info(self) -> dict[str, Any]:
        limits = self._limits
        return {
            "replica_id": self.replica_id,
            "address": self.engine.address(),
            "server_socket": self.engine.socket_path,
            "engine": self.engine.name,
            "state": self._state.value,
            "data_plane": self._data_plane.address if self._data_plane is not None else None,
            "data_plane_token": self._data_plane.token if self._data_plane is not None else None,
            "node_ip": self.engine.bind_host,
            "devices": self.engine.devices,
            "weight_version": self._version,
            "vocab_size": limits.vocab_size if limits else None,
            "max_model_len": limits.max_model_len if limits else None,
        }

    def _set_state(self, state: ReplicaState) -> None:
        self._state = state
        if self._gate is not None:
            if state == ReplicaState.SERVING or state not in HOLDING_STATES:
                self._gate.set()  # serving lets requests in; terminal states wake waiters to fail
            else:
                self._gate.clear()

    # ------------------------------------------------------------------ data plane
    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Optional[SamplingParams] = None, **kwargs: Any
    ) -> TokenOutput:
        """verl-compatible entry point: the output alone."""
        return (await self.generate_with_load(request_id, prompt_ids, sampling_params, **kwargs)).output

    async def generate_with_load(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        client_id: Optional[str] = None,
        **kwargs: Any,
    ) -> ReplicaResponse:
        """Validate, generate, stamp versions; return the output with this replica's load (split
        by ``client_id``, the sender's router's id: see :class:`~rollfleet.types.LoadReport`)."""
        async with self._admitted(request_id, prompt_ids, sampling_params, client_id) as call:
            if call.aborted:
                output = aborted_before_start()
            else:
                output = await self.engine.generate(call.engine_id, call.prompt, call.params, **kwargs)
        return ReplicaResponse(self._finished(output, call), self._report(client_id))

    async def generate_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        client_id: Optional[str] = None,
        **kwargs: Any,
    ) -> AsyncIterator[Union[TokenDelta, ReplicaResponse]]:
        """:meth:`generate_with_load` as it happens: token deltas as the engine samples them, then the
        output with the load (alone, from an engine that does not stream). Leaving early aborts it."""
        async with self._admitted(request_id, prompt_ids, sampling_params, client_id) as call:
            if call.aborted:
                yield ReplicaResponse(self._finished(aborted_before_start(), call), self._report(client_id))
                return
            stream = cast(
                AsyncGenerator, self.engine.generate_stream(call.engine_id, call.prompt, call.params, **kwargs)
            )
            try:
                async for item in stream:
                    if isinstance(item, TokenDelta):
                        item.token_versions = [call.version if v is None else v for v in item.token_versions]
                        yield item
                    else:
                        output = item
            finally:
                await stream.aclose()  # at once, not when collected: it aborts the engine's request
        yield ReplicaResponse(self._finished(output, call), self._report(client_id))

    @contextlib.asynccontextmanager
    async def _admitted(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams],
        client_id: Optional[str],
    ) -> AsyncIterator[Attempt]:
        """Validate a request, count it in flight, hold it at the gate while paused; on the way
        out, whatever happened, count it out (no leaked in-flight counts)."""
        self._check_accepting()
        limits = self._limits
        assert limits is not None and self._gate is not None
        try:
            if not isinstance(request_id, str):
                raise InvalidRequest("request_id", "a string", request_id)
            if client_id is not None and not isinstance(client_id, str):
                raise InvalidRequest("client_id", "a string (or none)", client_id)
            prompt = validate_prompt(prompt_ids, limits.vocab_size, limits.max_model_len)
            params = validate_sampling_params(
                sampling_params,
                prompt_len=len(prompt),
                vocab_size=limits.vocab_size,
                max_model_len=limits.max_model_len,
                default_max_tokens=self.config.response_length,
            )
        except Exception:
            self._counters["invalid"] += 1
            raise
        engine_id = f"{request_id}-{unique_hex()[-12:]}"  # the counter: unique in this process
        self._counters["requests"] += 1
        with self._book.entry(request_id, engine_id, len(prompt), client_id):
            try:
                self._book.hold(engine_id)
                try:
                    while not self._gate.is_set():
                        await self._gate.wait()
                finally:
                    aborted = self._book.release(engine_id)
                self._check_accepting()
                yield Attempt(
                    engine_id, prompt, params, self._epoch, self._version, time.monotonic(), aborted, self._keep_epoch
                )
            except ReplicaUnavailable:
                self._counters["errors"] += 1
                raise

    def _finished(self, output: TokenOutput, call: Attempt) -> TokenOutput:
        stamp_versions(output, call, epoch_now=self._epoch, version_now=self._version, keep_epoch_now=self._keep_epoch)
        output.extra_fields.setdefault("replica_id", self.replica_id)
        output.extra_fields.setdefault("generate_s", time.monotonic() - call.started)
        if output.stop_reason == "aborted":
            self._counters["aborted"] += 1
        self._counters["tokens_out"] += len(output.token_ids)
        return output

    def _check_accepting(self) -> None:
        if self._state in (ReplicaState.SERVING, *HOLDING_STATES):
            return
        raise ReplicaUnavailable(self.replica_id, f"state is '{self._state.value}'")

    def _report(self, client_id: Optional[str] = None, every_client: bool = False) -> LoadReport:
        """This replica's load; ``by_client`` holds ``client_id``'s share, or every client's."""
        load = self._liveness.load
        book = self._book
        by_client = book.by_client() if every_client else book.by_client(client_id) if client_id is not None else None
        return LoadReport(
            replica_id=self.replica_id,
            inflight=book.requests,
            inflight_tokens=book.tokens,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.kv_usage,
            weight_version=self._version,
            state=self._state.value,
            by_client=by_client,
        )

    async def abort(self, request_id: str) -> int:
        """Abort every attempt of one session on this replica, held at the gate or not; return how many."""
        ids = self._book.engine_ids(request_id)
        self._book.abort_held(ids)
        for engine_id in ids:
            if not self._book.is_held(engine_id):
                await self.engine.abort(engine_id)
        return len(ids)

    # ------------------------------------------------------------------ control plane
    async def abort_all(self) -> int:
        """Abort everything in flight, the attempts held at the gate included; return how many."""
        return self._book.abort_held() + await self.engine.abort_all()

    async def clear_kv_cache(self) -> None:
        await self.engine.clear_kv_cache()

    async def start_profile(self, **kwargs: Any) -> None:
        validate_profile_options(kwargs, self.engine.profile_options, self.engine.name)
        await self.engine.start_profile(**kwargs)

    async def stop_profile(self) -> Optional[str]:
        return await self.engine.stop_profile()

    async def health(self) -> dict[str, Any]:
        health = await self.engine.health()
        return {
            "replica_id": self.replica_id,
            "healthy": health.healthy,
            "detail": health.detail,
            "state": self._state.value,
        }

    async def load(self) -> LoadReport:
        """Poll the engine and return the full report; this is also the controller's liveness
        probe, answered within its timeout even when the engine is slow (see
        :mod:`rollfleet.server.liveness`): busy is not dead, silent is."""
        await self._liveness.poll()
        return self._report(every_client=True)

    async def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "replica_id": self.replica_id,
            "state": self._state.value,
            "weight_version": self._version,
            "pid": os.getpid(),
            "engine_devices": self.engine.devices,
        }
        out.update(self._counters)
        out.update(self.engine.stats())
        return out

    async def inject_fault(self, kind: str, factor: float = 10.0) -> None:
        """Fault injection for tests; only engines that simulate faults support it."""
        self._test_hook("inject_fault")(kind, factor)

    async def script_responses(self, script: Any) -> None:
        """Scripted responses for tests (sim engine)."""
        self._test_hook("script_responses")(script)

    def _test_hook(self, name: str) -> Any:
        hook = getattr(self.engine, name, None)
        if hook is None:
            raise NotSupported(self.engine.name, name)
        return hook

    async def ping(self) -> str:
        return self.replica_id


__all__ = ["Replica"]
