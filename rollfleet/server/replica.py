"""One replica: an engine behind input validation, version stamping and load reporting.

The logic lives in the plain class :class:`Replica` so it can be tested without Ray;
:data:`~rollfleet.server.actor.ReplicaActor` is the thin Ray actor around it (an asyncio actor, so
thousands of requests interleave in one process, as the engines expect). How outputs are labelled
with weight versions, and why here: :mod:`rollfleet.server.attempts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Optional, Union, cast

from rollfleet.config import RolloutConfig
from rollfleet.engines import Engine, EngineLimits, build_engine
from rollfleet.engines.base import CommitMode
from rollfleet.errors import NotSupported, ReplicaUnavailable
from rollfleet.health import ReplicaState
from rollfleet.server.attempts import Attempt, aborted_before_start, stamp_versions
from rollfleet.server.inflight import InflightBook
from rollfleet.server.liveness import EngineLiveness
from rollfleet.server.validation import validate_profile_options, validate_prompt, validate_sampling_params
from rollfleet.types import LoadReport, ReplicaResponse, SamplingParams, TokenDelta, TokenOutput
from rollfleet.utils.ids import unique_hex

if TYPE_CHECKING:
    from rollfleet.server.dataplane import DataPlaneServer

#: States in which requests wait at the replica's gate rather than fail: a pause for a weight
#: update or a sleep is short, and verl's contract is that requests queue on a paused engine.
_HOLDING_STATES = (ReplicaState.PAUSED, ReplicaState.SLEEPING)


class Replica:
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
        # Paused or asleep by the fleet's owner (pause/sleep until resume), told from an abort-mode
        # commit's own pause: an owner's pause or resume that lands while a commit loads is kept.
        self._owner_hold, self._committing, self._resumed_in_commit = False, False, False
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
            if state == ReplicaState.SERVING or state not in _HOLDING_STATES:
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
                yield Attempt(engine_id, prompt, params, self._epoch, self._version, time.monotonic(), aborted)
            except ReplicaUnavailable:
                self._counters["errors"] += 1
                raise

    def _finished(self, output: TokenOutput, call: Attempt) -> TokenOutput:
        stamp_versions(output, call, epoch_now=self._epoch, version_now=self._version)
        output.extra_fields.setdefault("replica_id", self.replica_id)
        output.extra_fields.setdefault("generate_s", time.monotonic() - call.started)
        if output.stop_reason == "aborted":
            self._counters["aborted"] += 1
        self._counters["tokens_out"] += len(output.token_ids)
        return output

    def _check_accepting(self) -> None:
        if self._state in (ReplicaState.SERVING, *_HOLDING_STATES):
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

    async def pause(self) -> None:
        """Hold new requests at the gate and abort in-flight ones (they return partial tokens)."""
        self._owner_hold = True
        if self._state == ReplicaState.SERVING:
            self._set_state(ReplicaState.PAUSED)
        await self.engine.pause()

    async def resume(self) -> None:
        """Generate again; an engine put to sleep is woken first (serving asleep would hang). Asked
        while an abort-mode commit loads, the commit resumes when the weights are in."""
        self._owner_hold = False
        if self._committing:
            self._resumed_in_commit = True
            return
        await self._serve()

    async def _serve(self) -> None:
        if self._state == ReplicaState.SLEEPING:
            await self.engine.wake_up()
        await self.engine.resume()
        if self._state in _HOLDING_STATES:
            self._set_state(ReplicaState.SERVING)

    async def sleep(self) -> None:
        await self.engine.sleep()  # NotSupported propagates before the state changes
        self._owner_hold = True
        if self._state in (ReplicaState.SERVING, ReplicaState.PAUSED):
            self._set_state(ReplicaState.SLEEPING)

    async def wake_up(self) -> None:
        await self.engine.wake_up()
        if self._state == ReplicaState.SLEEPING:
            self._set_state(ReplicaState.PAUSED)

    async def update_weights(self, weights: Any, version: int, *, resume: bool = True) -> dict[str, Any]:
        """Both phases at once, in ``abort`` mode: stage, then commit (see :meth:`commit_weights`)."""
        await self.stage_weights(weights, version)
        return await self.commit_weights(version, "abort", resume=resume)

    async def stage_weights(self, weights: Any, version: int) -> float:
        """Phase 1, while serving: the engine brings ``weights`` (resolved from the object store on
        this node by Ray) to where its commit loads them from. Returns the seconds it took."""
        started = time.monotonic()
        await self.engine.stage_weights(weights, version)
        return time.monotonic() - started

    async def commit_weights(self, version: int, mode: CommitMode = "keep", *, resume: bool = True) -> dict[str, Any]:
        """Phase 2: load the staged ``version``; stamp it only once the weights really loaded.

        ``keep`` (when the engine can; else ``abort``): the engine freezes its in-flight requests
        and continues them on the new weights, the replica keeps serving. ``abort``: hold new
        requests at the gate, abort in-flight ones (they return partial tokens), load, clear the
        prefix cache [, resume, if it was serving before]; a failed load leaves it paused.
        Returns the mode used, ``pause_s`` (the seconds the engine generated nothing) and its
        ``window`` (wall-clock start and end).
        """
        started = time.time()
        if mode == "keep" and "keep" in self.engine.update_modes and self._state != ReplicaState.SYNCING:
            await self.engine.commit_weights(version, "keep")
            self._set_version(version)
            # The engine's own pause window where it reports one (the call also releases files).
            window = (getattr(self.engine, "last_commit", None) or {}).get("window") or (started, time.time())
            return {"mode": "keep", "pause_s": window[1] - window[0], "window": list(window)}
        # Resumed after if serving (or starting) before, or if the fleet's owner resumed it while it
        # loaded; paused or asleep by the owner (the learner has the devices), it stays so.
        resumes = resume and self._state in (ReplicaState.SERVING, ReplicaState.SYNCING)
        if self._state == ReplicaState.SERVING:
            self._set_state(ReplicaState.PAUSED)
        # A load that fails leaves the replica paused: its weights may be half loaded, and it
        # must not generate on them under the old label (the controller fences and restarts it).
        self._committing, self._resumed_in_commit = True, False
        try:
            await self.engine.pause()
            await self.engine.commit_weights(version, "abort")
            await self.engine.clear_kv_cache()
            self._set_version(version)
        finally:
            self._committing = False
        if (resumes or self._resumed_in_commit) and not self._owner_hold and self._state in _HOLDING_STATES:
            await self._serve()
        ended = time.time()
        return {"mode": "abort", "pause_s": ended - started, "window": [started, ended]}

    async def weights_checksum(self) -> dict[str, Any]:
        """The version this replica serves and its engine's weight digest (None: cannot tell)."""
        return {"version": self._version, "checksum": await self.engine.weights_checksum()}

    def _set_version(self, version: int) -> None:
        self._version = version
        self._epoch += 1
        if self._state == ReplicaState.SYNCING:
            self._set_state(ReplicaState.PAUSED)  # a restarted replica now has the current weights

    async def set_version(self, version: int) -> None:
        """Stamp a version without loading weights (the weights were placed by other means)."""
        self._set_version(version)

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
