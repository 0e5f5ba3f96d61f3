"""The direct data plane: frames, a replica served over a socket, and the failure semantics the
client's retry rules rely on (typed errors, cancellation crossing the wire, lost connections)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import pickle
from typing import AsyncIterator

import pytest

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.errors import InvalidRequest, ReplicaUnavailable
from rollfleet.server import wire
from rollfleet.server.dataplane import DataPlaneServer
from rollfleet.server.direct import DirectHandle, close_connections, get_connection
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica
from rollfleet.types import LoadReport, ReplicaResponse, TokenOutput

pytestmark = pytest.mark.unit


@contextlib.asynccontextmanager
async def served_replica(time_scale: float = 1000.0) -> AsyncIterator[tuple[Replica, DirectHandle]]:
    """A sim replica serving its data plane on loopback, and a handle to it; closed afterwards."""
    cfg = RolloutConfig(
        name="sim",
        prompt_length=64,
        response_length=64,
        max_model_len=4096,
        sim=SimEngineConfig(vocab_size=500, time_scale=time_scale, mean_response_tokens=20),
    )
    r = Replica("r0", cfg, 0)
    await r.start(version=3)
    address = await r.serve_data_plane("127.0.0.1")
    try:
        yield r, DirectHandle(LocalHandle(r), address, "r0", r._data_plane.token)
    finally:
        close_connections()
        await r.shutdown()


async def until(predicate, tries: int = 100, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds (True) or ``tries`` run out (False)."""
    for _ in range(tries):
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return predicate()


def test_frames_survive_any_split_of_the_byte_stream():
    messages = [[wire.GENERATE, i, f"req-{i}", list(range(i)), {"max_tokens": i + 1}, {}] for i in range(20)]
    messages.append([wire.CANCEL, 7])
    error = wire.error_frame(1, InvalidRequest("prompt_ids", "< 10 tokens", [1] * 11))
    assert error[4] == wire.JSON  # errors never need pickle
    stream = b"".join(wire.pack(m) for m in messages) + error
    for chunk in (1, 3, 7, 64, len(stream)):
        reader = wire.FrameReader()
        got = []
        for start in range(0, len(stream), chunk):
            got.extend(reader.feed(stream[start : start + chunk]))
        assert got[:-1] == messages
        err = wire.decode_error(got[-1][2])
        assert isinstance(err, InvalidRequest) and err.field == "prompt_ids" and err.limit == "< 10 tokens"


def test_errors_travel_as_json_with_their_type_and_fields():
    from rollfleet.errors import NotSupported

    for exc in (
        ReplicaUnavailable("r3", "engine gone"),
        NotSupported("vllm", "sleep", "CPU build"),
        TimeoutError("took too long"),
        ValueError("bad"),
    ):
        (message,) = list(wire.FrameReader().feed(wire.error_frame(4, exc)))
        back = wire.decode_error(message[2])
        assert type(back) is type(exc) and str(back) == str(exc)
    (message,) = list(wire.FrameReader().feed(wire.error_frame(4, KeyError("k"))))
    back = wire.decode_error(message[2])  # anything else: a RuntimeError naming what it was
    assert type(back) is RuntimeError and "KeyError" in str(back)


def test_non_json_values_need_pickle_switched_on_and_nan_logprobs_come_back_as_nan():
    with pytest.raises(wire.NeedsPickle, match="data_plane_pickle"):
        wire.generate_frame(1, "r", [1, 2], {"max_tokens": 2}, {"image": b"\x89PNG"})
    frame = wire.generate_frame(1, "r", [1, 2], {"max_tokens": 2}, {"image": b"\x89PNG"}, allow_pickle=True)
    assert frame[4] == wire.PICKLE
    with pytest.raises(wire.FrameError, match="pickle frame refused"):
        list(wire.FrameReader().feed(frame))  # a reader takes pickle only when told to
    (message,) = list(wire.FrameReader(allow_pickle=True).feed(frame))
    assert message[5] == {"image": b"\x89PNG"}

    out = TokenOutput(
        token_ids=[4, 5, 6], log_probs=[-0.5, math.nan, -1.25], stop_reason="length", token_versions=[2, 2, 2]
    )
    response = ReplicaResponse(out, LoadReport("r0", inflight=3, weight_version=2, state="serving"))
    frame = wire.response_frame(9, response)
    assert frame[4] == wire.JSON
    (message,) = list(wire.FrameReader().feed(frame))
    back = wire.decode_response(message[2], message[3])
    assert back.output.token_ids == [4, 5, 6] and back.output.stop_reason == "length"
    assert back.output.log_probs[0] == -0.5 and math.isnan(back.output.log_probs[1])
    assert back.load.inflight == 3 and back.load.weight_version == 2


def test_oversized_or_unknown_frames_are_refused():
    with pytest.raises(wire.FrameError, match="frame length"):
        list(wire.FrameReader().feed(b"\xff\xff\xff\xff\x00"))
    with pytest.raises(wire.FrameError, match="unknown frame kind"):
        list(wire.FrameReader().feed(b"\x02\x00\x00\x00\x09x"))


async def test_generate_over_the_socket_matches_the_in_process_call():
    async with served_replica() as (r, handle):
        params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        direct = await handle.generate_with_load.remote("s", [5, 6, 7], params)
        local = await LocalHandle(r).generate_with_load.remote("s", [5, 6, 7], params)
        assert direct.output.token_ids == local.output.token_ids and len(direct.output.token_ids) == 12
        assert direct.output.log_probs == local.output.log_probs
        assert direct.output.extra_fields["global_steps"] == 3 and direct.output.token_versions == [3] * 12
        assert direct.load.replica_id == "r0" and direct.load.inflight == 0
        only_output = await handle.generate.remote("s", [5, 6, 7], params)
        assert isinstance(only_output, TokenOutput) and only_output.token_ids == local.output.token_ids
        # every other call is the actor's (here the in-process handle's)
        assert await handle.ping.remote() == "r0"


async def test_many_concurrent_requests_share_one_connection_and_leave_no_inflight():
    async with served_replica(time_scale=1e5) as (r, handle):
        outs = await asyncio.gather(
            *(handle.generate.remote(f"s{i}", [1 + i % 400, 2, 3], {"max_tokens": 4}) for i in range(1000))
        )
        assert all(len(o.token_ids) >= 1 for o in outs)
        assert r._data_plane.num_connections == 1
        assert r._book.requests == 0 and r._book.tokens == 0


async def test_bad_input_arrives_typed_and_the_connection_keeps_serving():
    async with served_replica() as (r, handle):
        with pytest.raises(InvalidRequest) as info:
            await handle.generate.remote("bad", [1, 2, 500], {"max_tokens": 4})
        assert info.value.field == "prompt_ids[2]" and "vocab_size (500)" in str(info.value)
        with pytest.raises(InvalidRequest) as info:
            await handle.generate.remote("bad", [1, 2], {"max_tokens": -3})
        assert info.value.field == "sampling_params.max_tokens"
        out = await handle.generate.remote("good", [1, 2], {"max_tokens": 4})
        assert len(out.token_ids) >= 1
        assert r._counters["invalid"] == 2 and r._book.requests == 0


async def test_cancelling_the_caller_aborts_the_request_on_the_replica():
    async with served_replica(time_scale=20.0) as (r, handle):
        task = handle.generate.remote("long", [1, 2, 3], {"max_tokens": 3000, "ignore_eos": True})
        await until(lambda: r._book.requests == 1)
        assert r._book.requests == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: r._book.requests == 0)
        assert r._book.requests == 0 and r._book.tokens == 0
        assert r.engine.stats()["num_aborted"] >= 1
        conn = await get_connection(handle.address, "r0", handle.token)
        assert conn._pending == {}
        assert len((await handle.generate.remote("next", [1], {"max_tokens": 2})).token_ids) >= 1


async def test_a_lost_connection_fails_pending_requests_as_replica_unavailable(caplog):
    from rollfleet.server import direct

    async with served_replica(time_scale=20.0) as (r, handle):
        pending = [handle.generate.remote(f"p{i}", [1, 2], {"max_tokens": 3000, "ignore_eos": True}) for i in range(5)]
        await asyncio.sleep(0.1)
        await r._data_plane.close()  # the replica's process went away
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(e, ReplicaUnavailable) and e.replica_id == "r0" for e in results)
        with pytest.raises(ReplicaUnavailable, match="cannot reach its data plane"):
            await get_connection(handle.address, "r0", handle.token)

        def ray_path_warnings() -> list[str]:
            return [rec.getMessage() for rec in caplog.records if "through Ray instead" in rec.getMessage()]

        # The replica itself is alive: its requests take the actor path instead of failing, a
        # stream as one piece (said once, in the log: a stream that arrives whole is no silent loss).
        direct._WARNED.discard(handle.address)
        with caplog.at_level("WARNING", logger="rollfleet.server.direct"):
            items = [item async for item in handle.stream_generate("s", [1], {"max_tokens": 2})]
        assert len(items) == 1 and isinstance(items[0], ReplicaResponse) and items[0].output.token_ids
        assert len(ray_path_warnings()) == 1, ray_path_warnings()
        assert len((await handle.generate.remote("again", [1], {"max_tokens": 2})).token_ids) >= 1
        assert len(ray_path_warnings()) == 1  # once per address, not once per call
        no_actor = DirectHandle(None, handle.address, "r0", handle.token)
        with pytest.raises(ReplicaUnavailable, match="cannot reach its data plane"):
            await no_actor.generate.remote("again", [1], {"max_tokens": 2})
        await until(lambda: r._book.requests == 0)  # the replica cancelled the orphaned requests
        assert r._book.requests == 0


class _Boom:
    def __reduce__(self):  # would run on unpickling
        return (_explode, ())


_EXPLODED: list[bool] = []


def _explode() -> None:
    _EXPLODED.append(True)


async def _refused(address: str, payload: bytes) -> bool:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    closed = await asyncio.wait_for(reader.read(), 5) == b""  # the replica hangs up
    writer.close()
    return closed


async def test_peers_without_the_token_or_speaking_garbage_are_dropped_and_others_keep_being_served():
    async with served_replica() as (r, handle):
        assert await _refused(handle.address, b"GET / HTTP/1.1\r\n\r\n")
        assert await _refused(handle.address, wire.hello_frame("not-the-token"))
        request = wire.generate_frame(1, "x", [1, 2], {"max_tokens": 3}, {})
        assert await _refused(handle.address, request)  # no hello first
        assert await _refused(handle.address, wire.pack([wire.HELLO, _Boom()], allow_pickle=True))
        assert _EXPLODED == []  # nothing was unpickled for a peer that had not said hello
        assert r._counters["requests"] == 0
        assert len((await handle.generate.remote("ok", [1, 2], {"max_tokens": 3})).token_ids) >= 1


def test_direct_handle_pickles_to_actor_address_and_id():
    handle = DirectHandle("actor-placeholder", "10.0.0.5:4242", "replica-3", "secret", True)
    back = pickle.loads(pickle.dumps(handle))
    assert (back.actor, back.address, back.replica_id, back.token, back.allow_pickle) == (
        "actor-placeholder",
        "10.0.0.5:4242",
        "replica-3",
        "secret",
        True,
    )
    assert back == handle and hash(back) == hash(handle)
    assert back != DirectHandle("actor-placeholder", "10.0.0.5:4243", "replica-3")


async def test_data_plane_binds_inside_the_configured_port_range():
    import socket

    from rollfleet.config import RolloutConfig as _RC

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    r = Replica("r0", _RC(name="sim"), 0)
    try:
        with pytest.raises(OSError, match=r"rollout.data_plane_ports: every port of"):
            await DataPlaneServer(r, "127.0.0.1", port_range=(busy, busy)).start()
        server = DataPlaneServer(r, "127.0.0.1", port_range=(busy, busy + 3))
        address = await server.start()  # never the busy port, always inside the range
        assert busy < int(address.rpartition(":")[2]) <= busy + 3
        await server.close()
    finally:
        taken.close()
    assert _RC(data_plane_ports=(20000, 20099)).data_plane_ports == (20000, 20099)
    with pytest.raises(ValueError, match="data_plane_ports must satisfy"):
        _RC(data_plane_ports=(9000, 8000))


async def test_an_output_that_cannot_be_sent_fails_the_call_instead_of_hanging():
    class Unsendable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    class Target:
        async def generate_with_load(self, request_id, prompt_ids, sampling_params=None, **kwargs):
            out = TokenOutput(token_ids=[1], routed_experts=Unsendable())
            return ReplicaResponse(out, LoadReport("t0"))

    cases = ((False, RuntimeError, "rollout.data_plane_pickle is off"), (True, TypeError, "cannot pickle this"))
    for allow_pickle, kind, error in cases:
        server = DataPlaneServer(Target(), "127.0.0.1", allow_pickle=allow_pickle)
        address = await server.start()
        try:
            handle = DirectHandle(None, address, "t0", server.token, allow_pickle)
            with pytest.raises(kind, match=error):
                await asyncio.wait_for(handle.generate.remote("x", [1], {}), 5)
        finally:
            close_connections()
            await server.close()


async def test_a_request_json_cannot_carry_takes_the_ray_path_while_pickle_is_off():
    async with served_replica() as (r, handle):
        out = await handle.generate_with_load.remote("mm", [1, 2], {"max_tokens": 3}, image_data=b"\x89PNG")
        assert len(out.output.token_ids) >= 1
        assert r._data_plane.num_connections <= 1 and r._counters["requests"] == 1
        no_actor = DirectHandle(None, handle.address, "r0", handle.token)
        with pytest.raises(wire.NeedsPickle):
            await no_actor.generate.remote("mm", [1, 2], {"max_tokens": 3}, image_data=b"\x89PNG")


async def test_an_unauthenticated_peer_is_dropped_within_the_deadline_having_cost_about_a_kilobyte():
    async with served_replica() as (r, handle):
        server = r._data_plane
        server.hello_timeout_s = 0.3
        host, _, port = handle.address.rpartition(":")
        # A peer that announces a 200 MB frame is dropped at once, before it sends more.
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((200 * 1024 * 1024).to_bytes(4, "little") + b"\x00" + b"x" * 60_000)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # A silent peer is dropped at the handshake deadline.
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 0.25 <= loop.time() - started < 3.0
        writer.close()
        assert await until(lambda: server.num_connections <= 1)
        # The cap: connections over max_connections are closed as they arrive.
        server.max_connections = server.num_connections
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        server.max_connections = 1024
        assert len((await handle.generate.remote("ok", [1, 2], {"max_tokens": 3})).token_ids) >= 1


async def test_dropping_the_connection_of_a_dead_replica_fails_its_calls_over_at_once():
    async with served_replica(time_scale=20.0) as (r, handle):
        pending = [handle.generate.remote(f"d{i}", [1, 2], {"max_tokens": 3000, "ignore_eos": True}) for i in range(4)]
        assert await until(lambda: r._book.requests == 4)
        handle.drop_connection("replica-0 declared dead by the fleet: probe failed (2x)")
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        assert all(isinstance(e, ReplicaUnavailable) and "declared dead" in e.reason for e in results)
        assert await until(lambda: r._book.requests == 0)  # the replica side was cancelled too
        assert len((await handle.generate.remote("after", [1], {"max_tokens": 2})).token_ids) >= 1


async def test_a_stream_over_the_socket_sends_tokens_as_sampled_and_a_caller_that_leaves_aborts_it():
    """STREAM calls: PART frames as the engine samples (more than one), then the whole output with
    the load; the parts add up to it. Leaving the stream early cancels the request on the replica."""
    from rollfleet.types import TokenDelta

    async with served_replica(time_scale=20.0) as (replica, handle):
        params = {"max_tokens": 60, "ignore_eos": True}
        items = [item async for item in handle.stream_generate("s1", [1, 2, 3], params)]
        *deltas, last = items
        assert len(deltas) > 3 and all(isinstance(d, TokenDelta) for d in deltas)
        assert isinstance(last, ReplicaResponse) and len(last.output.token_ids) == 60
        assert [t for d in deltas for t in d.token_ids] == last.output.token_ids
        assert {v for d in deltas for v in d.token_versions} == {3}  # stamped with the replica's version
        stream = handle.stream_generate("s2", [1, 2, 3], {"max_tokens": 4000, "ignore_eos": True})
        async for item in stream:
            assert isinstance(item, TokenDelta)
            break
        await stream.aclose()  # type: ignore[attr-defined]
        assert await until(lambda: replica._book.requests == 0)
        assert replica.engine.stats()["num_aborted"] == 1


async def test_a_request_over_the_frame_limit_takes_the_ray_path_and_its_connection_keeps_serving(monkeypatch):
    """Sent, a frame over the limit made the replica close the connection: every call on it failed
    as ReplicaUnavailable, its replica was quarantined, and the retry did the same elsewhere."""
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 8 * 1024)
    long_prompt = list(range(100, 400)) * 9  # 2,700 ids: about 13 KB of JSON
    async with served_replica(time_scale=20.0) as (r, handle):
        others = [handle.generate.remote(f"o{i}", [1, 2], {"max_tokens": 40, "ignore_eos": True}) for i in range(4)]
        assert await until(lambda: r._book.requests == 4)
        big = await handle.generate.remote("big", long_prompt, {"max_tokens": 3})
        assert len(big.token_ids) >= 1  # through the actor
        assert all(len(out.token_ids) == 40 for out in await asyncio.gather(*others))
        assert r._data_plane.num_connections == 1
        no_actor = DirectHandle(None, handle.address, "r0", handle.token)
        with pytest.raises(wire.FrameTooLarge, match="over the data plane's 8192"):
            await no_actor.generate.remote("big", long_prompt, {"max_tokens": 3})
        monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 600)  # a reply over the limit fails its call only
        with pytest.raises(RuntimeError, match="FrameTooLarge"):
            await handle.generate.remote("long", [1, 2], {"max_tokens": 200, "ignore_eos": True})
        monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 8 * 1024)
        assert len((await handle.generate.remote("after", [1, 2], {"max_tokens": 3})).token_ids) >= 1
        assert r._data_plane.num_connections == 1


async def test_a_sampling_parameter_json_cannot_carry_is_refused_naming_it_not_sent_as_null():
    """JSON has no NaN: orjson sent null, which reads as "not given", so NaN or infinity passed the
    replica's check on the data plane (the Ray path refused them) and ran as the default."""
    async with served_replica() as (r, handle):
        for key, value in (("temperature", math.nan), ("top_p", math.inf), ("repetition_penalty", -math.inf)):
            with pytest.raises(InvalidRequest) as err:
                await handle.generate.remote("n", [1, 2], {"max_tokens": 3, key: value})
            assert err.value.field == f"sampling_params.{key}"
        nested = (  # inside a mapping or a list too: a passthrough key sent as null was dropped
            ({"logit_bias": {"5": math.inf}}, "sampling_params.logit_bias.5"),
            ({"passthrough": {"length_penalty": math.nan}}, "sampling_params.passthrough.length_penalty"),
            ({"passthrough": {"weights": [1.0, [0.5, -math.inf]]}}, "sampling_params.passthrough.weights.1.1"),
        )
        for params, field in nested:
            with pytest.raises(InvalidRequest) as err:
                await handle.generate.remote("n", [1, 2], {"max_tokens": 3, **params})
            assert err.value.field == field
        assert r._counters["requests"] == 0


async def test_sampling_params_that_are_no_dict_are_refused_naming_them_before_anything_is_sent():
    """``generate_frame`` read ``.items()`` of whatever it was given: a bare AttributeError."""
    async with served_replica() as (r, handle):
        for bad in ("abc", [("max_tokens", 4)]):
            with pytest.raises(InvalidRequest) as err:
                await handle.generate.remote("d", [1, 2], bad)
            assert err.value.field == "sampling_params"
        with pytest.raises(InvalidRequest) as err:  # an integer JSON cannot carry
            await handle.generate.remote("d", [1, 2], {"max_tokens": 3, "seed": 2**64})
        assert err.value.field == "sampling_params.seed"
        assert r._counters["requests"] == 0


async def test_a_stream_part_json_cannot_carry_fails_its_call_alone_with_pickle_off(monkeypatch):
    """PART frames were packed with pickle allowed whatever the connection's setting: a delta
    holding a numpy float went as a PICKLE frame, the client (pickle off) refused it and closed
    the shared connection, failing every other call on it."""
    import numpy as np

    from rollfleet.types import TokenDelta

    async with served_replica() as (r, handle):
        real = r.engine.generate_stream

        async def numpy_deltas(engine_id, prompt, params, **kw):
            if engine_id.startswith("np-"):
                yield TokenDelta([1], [np.float32(-0.5)], [None])
            async for item in real(engine_id, prompt, params, **kw):
                yield item

        monkeypatch.setattr(r.engine, "generate_stream", numpy_deltas)
        other = asyncio.ensure_future(handle.generate.remote("other", [1, 2], {"max_tokens": 40, "ignore_eos": True}))
        with pytest.raises(Exception, match="NeedsPickle"):
            async for _ in handle.stream_generate("np", [1, 2, 3], {"max_tokens": 8}):
                pass
        assert len((await other).token_ids) == 40  # the call beside it, on the same connection
        assert len((await handle.generate.remote("after", [1, 2], {"max_tokens": 3})).token_ids) >= 1
        assert r._data_plane.num_connections == 1
        assert await until(lambda: r._book.requests == 0)


async def test_a_stream_call_with_arguments_it_cannot_take_is_answered_with_an_error():
    """A STREAM frame whose kwargs were not a dict failed before the call's error handling: no
    answer ever came (the caller would hang) and the call stayed listed on the connection."""
    async with served_replica() as (r, handle):
        host, _, port = handle.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(wire.hello_frame(r._data_plane.token))
        writer.write(wire.pack([wire.STREAM, 1, "x", [1, 2], {"max_tokens": 4}, [1]]))
        frames = wire.FrameReader()
        answer = None
        while answer is None:
            got = list(frames.feed(await asyncio.wait_for(reader.read(65536), 5)))
            answer = got[0] if got else None
        assert answer[:2] == [1, wire.ERROR] and answer[2][0] == "TypeError"
        connection = next(iter(r._data_plane._connections))
        assert await until(lambda: not connection._tasks)
        writer.close()


async def test_an_address_that_cannot_be_reached_is_not_tried_again_for_a_while(monkeypatch):
    """Each request paid the connect timeout again (5 s) before taking the Ray path."""
    import rollfleet.server.direct as direct

    async with served_replica() as (r, handle):
        opened: list[str] = []

        async def unreachable(address, replica_id, token, allow_pickle):
            opened.append(address)
            raise ReplicaUnavailable(replica_id, f"cannot reach its data plane at {address}: TimeoutError()")

        monkeypatch.setattr(direct, "_open", unreachable)
        for i in range(3):
            assert len((await handle.generate.remote(f"u{i}", [1, 2], {"max_tokens": 3})).token_ids) >= 1
        assert opened == [handle.address]  # once; the others went straight to the actor
        entry = direct._POOLS[asyncio.get_running_loop()][handle.address]
        entry.until = 0.0  # the retry interval is over: tried again
        await handle.generate.remote("later", [1, 2], {"max_tokens": 3})
        assert opened == [handle.address] * 2
