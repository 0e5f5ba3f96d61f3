"""Unit tests of the shared HTTP-engine core (``rollfleet.engines.http``): the one finish-reason rule
(one table, through both engines' wire parsers), metrics, vocabulary, error bodies, the
transport-error rule, the in-flight table and the supervised process (real processes)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import aiohttp
import httpx
import orjson
import pytest

from rollfleet.engines.http import error_message, metric_samples, parse_metrics, read_vocab_size, stop_reason
from rollfleet.engines.http.inflight import Inflight, InflightTable
from rollfleet.engines.http.process import ServerProcess, ServerStartupError
from rollfleet.engines.http.transport import is_refused, is_stale, is_timeout, transport_error
from rollfleet.engines.sglang import wire as sglang_wire
from rollfleet.engines.vllm import wire as vllm_wire
from rollfleet.errors import EngineDead, ReplicaUnavailable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# ---------------------------------------------------------------------------------------- stop reasons

#: (server finish reason, tokens generated, budget, stop_reason): the one table both engines follow.
STOP_REASONS = [
    ("stop", 3, 10, "stop"),
    ("stop", 10, 10, "stop"),
    ("length", 10, 10, "length"),
    ("abort", 4, 10, "aborted"),
    ("abort", 0, 10, "aborted"),
    ("repetition", 6, 10, "stop"),  # the server ended it on purpose: resuming would only repeat
    (None, 10, 10, "length"),  # unexplained, budget used up
    (None, 4, 10, "aborted"),  # unexplained early end: resumable, never a silent "stop"
    ("error", 4, 10, "aborted"),
    ("something-new", 2, 10, "aborted"),
    ("something-new", 12, 10, "length"),
    (None, 0, None, "aborted"),
]


def _vllm_answer(finish, n):
    tokens = list(range(1, n + 1))
    return orjson.dumps({"choices": [{"token_ids": tokens, "finish_reason": finish,
                                      "logprobs": {"token_logprobs": [-0.5] * n}}]})  # fmt: skip


def _sglang_answer(finish, n):
    meta = {
        "finish_reason": None if finish is None else {"type": finish},
        "output_token_logprobs": [[-0.5, t, None] for t in range(1, n + 1)],
    }
    return {"output_ids": list(range(1, n + 1)), "meta_info": meta}


@pytest.mark.parametrize("finish, n, budget, expected", STOP_REASONS)
def test_one_stop_reason_rule_for_both_engines(finish, n, budget, expected):
    assert stop_reason(finish, n, budget) == expected
    assert vllm_wire.parse_completion(_vllm_answer(finish, n), budget).stop_reason == expected
    assert sglang_wire.parse_generate(_sglang_answer(finish, n), budget).stop_reason == expected


# ---------------------------------------------------------------------------------------- metrics, vocab, errors


def test_parse_metrics_sums_label_sets_and_filters():
    text = (
        "# HELP vllm:num_requests_running n\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "# HELP vllm:kv_cache_usage_perc k\n# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 5.0
    assert m["vllm:kv_cache_usage_perc"] == 0.25
    text += (
        "# HELP vllm:num_requests_running_x x\n# TYPE vllm:num_requests_running_x gauge\n"
        'vllm:num_requests_running_x{engine="0"} 7.0\n'
        "# HELP vllm:prefix_cache_hits_total h\n# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0"} 9.0\n'
        'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n'
        "# HELP lat l\n# TYPE lat histogram\n"
        'lat_bucket{le="+Inf"} 4.0\n'
        "lat_count 4.0\n"
        "lat_sum 2.0\n"
    )
    only = parse_metrics(text, ["vllm:num_requests_running", "vllm:prefix_cache_hits_total"])
    assert only == {"vllm:num_requests_running": 5.0, "vllm:prefix_cache_hits_total": 9.0}
    everything = parse_metrics(text)
    assert everything["vllm:num_requests_running_x"] == 7.0 and everything["lat_count"] == 4.0
    assert not any(name.endswith("_bucket") for name in everything)
    assert metric_samples(text, ["vllm:num_requests_running"]) == {"vllm:num_requests_running": [3.0, 2.0]}


def test_read_vocab_size(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"vocab_size": 1028}))
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text("{}")
    assert read_vocab_size(str(tmp_path / "plain")) == 1028
    assert read_vocab_size(str(tmp_path / "mm")) == 151936
    assert read_vocab_size(str(tmp_path / "none")) is None
    assert read_vocab_size(str(tmp_path / "missing")) is None and read_vocab_size(None) is None


def test_error_message_reads_every_body_shape():
    assert error_message(400, b'{"error": {"message": "bad t", "param": "temperature"}}') == ("bad t", "temperature")
    assert error_message(400, b'{"object": "error", "message": "m", "param": "top_p"}') == ("m", "top_p")
    assert error_message(422, b'{"detail": "missing"}') == ("missing", None)
    assert error_message(500, b'{"error": "Failed to pause"}') == ("Failed to pause", None)
    assert error_message(502, b"Bad gateway\n") == ("Bad gateway", None)
    assert error_message(503, b"") == ("HTTP 503", None)


# ---------------------------------------------------------------------------------------- transport rule


def test_transport_predicates():
    refused = aiohttp.ClientConnectorError(None, OSError(111, "Connection refused"))  # type: ignore[arg-type]
    assert is_refused(refused) and not is_stale(refused)
    assert is_stale(aiohttp.ServerDisconnectedError()) and not is_refused(aiohttp.ServerDisconnectedError())
    assert (
        is_timeout(asyncio.TimeoutError())
        and is_timeout(httpx.ReadTimeout("t"))
        and is_timeout(aiohttp.ServerTimeoutError())
    )
    assert not is_stale(aiohttp.ServerTimeoutError())
    assert is_refused(httpx.ConnectError("refused")) and not is_refused(httpx.ConnectTimeout("slow"))


@pytest.mark.asyncio
async def test_transport_error_rule():
    async def alive():
        return None

    async def gone():
        return "server process 7 exited with code -9"

    slow = await transport_error("op", httpx.ReadTimeout("t"), "r-0", "http://x", gone)
    assert type(slow) is ReplicaUnavailable  # a timeout is busy, not dead, even with a dead process
    dead = await transport_error("op", httpx.RemoteProtocolError("x"), "r-0", "http://x", gone)
    assert isinstance(dead, EngineDead) and "exited with code -9" in dead.reason
    refused = await transport_error("op", httpx.ConnectError("refused"), "r-0", "http://x", alive)
    assert isinstance(refused, EngineDead) and "cannot connect" in refused.reason
    other = await transport_error("op", httpx.RemoteProtocolError("reset"), "r-0", "http://x", alive)
    assert type(other) is ReplicaUnavailable


# ---------------------------------------------------------------------------------------- in-flight table


@pytest.mark.asyncio
async def test_gate_holds_until_every_hold_is_released_or_the_call_is_aborted():
    table, dead = InflightTable(), asyncio.Event()
    table.hold("pause")
    table.hold("sleep")
    a = table.add(Inflight("a", "a", 5))
    waiter = asyncio.create_task(table.wait_turn(a, dead))
    table.release("pause")
    await asyncio.sleep(0.02)
    assert not waiter.done() and table.held() == 1  # still asleep
    table.release("sleep")
    await asyncio.wait_for(waiter, 1)
    b = table.add(Inflight("b", "b", 5))
    table.hold("pause")
    waiter = asyncio.create_task(table.wait_turn(b, dead))
    await table.drain([b], send_abort=None, alive=lambda: True)  # type: ignore[arg-type] # held: nothing to send
    await asyncio.wait_for(waiter, 1)
    assert b.aborted.is_set() and table.tokens() == 10


@pytest.mark.asyncio
async def test_drain_re_sends_the_abort_while_a_request_is_still_on_the_wire():
    table = InflightTable()
    call = table.add(Inflight("a", "a", 5, sent=True))
    sent: list[tuple[list[str], bool]] = []

    async def send_abort(out, first):
        sent.append(([c.wire_id for c in out], first))
        if len(sent) == 3:  # the server finally knows the request: it comes back
            table.remove(call)

    t0 = time.monotonic()
    await table.drain([call], send_abort, alive=lambda: True)
    assert sent == [(["a"], True), (["a"], False), (["a"], False)]
    assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------------------------------- supervised process


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _watched_server_with_a_child(label: str) -> tuple[ServerProcess, list[str], list[int]]:
    """A watched server that started one child, as vLLM's API server starts EngineCore: the
    server, the deaths its watcher reported, and [server pid, child pid]."""
    server = ServerProcess(label, "test server")
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    server.spawn([sys.executable, "-c", child], dict(os.environ))
    exits: list[str] = []
    server.watch(exits.append)
    await _until(lambda: "up" in server.log_tail())
    import psutil

    family = [server.pid] + [c.pid for c in psutil.Process(server.pid).children(recursive=True)]
    assert len(family) == 2
    return server, exits, family


@pytest.mark.asyncio
async def test_process_is_watched_killed_as_a_group_and_its_workdir_removed():
    server, exits, family = await _watched_server_with_a_child("core-0")
    await server.kill(grace_s=2.0)
    await _until(lambda: not any(_alive(p) for p in family))
    assert exits == []  # a kill by its owner is not reported as a death
    server.remove_workdir()
    assert not server.workdir.exists()


@pytest.mark.asyncio
async def test_a_dead_leader_takes_the_processes_it_started_with_it(monkeypatch):
    """vLLM's EngineCore does not notice its API server dying: when the leader is SIGKILLed, the
    watcher reports the death and kills the rest of the group, with no shutdown called."""
    server, exits, (leader, orphan) = await _watched_server_with_a_child("core-2")
    os.kill(leader, signal.SIGKILL)
    await _until(lambda: bool(exits))
    assert "exited with code -9" in exits[0]
    await _until(lambda: not _alive(orphan))
    # The group's id is free for reuse from now on: a later shutdown (the replica's restart) and
    # the atexit hook must not signal it again.
    from rollfleet.engines.http import process

    signalled: list[int] = []
    monkeypatch.setattr(process, "_signal_group", lambda pgid, sig: signalled.append(pgid))
    await server.kill(grace_s=5.0)
    assert signalled == [] and leader not in process._LIVE_GROUPS
    server.remove_workdir()


@pytest.mark.asyncio
async def test_exit_is_reported_and_start_up_failure_carries_the_log_tail():
    server = ServerProcess("core-1", "test server")
    server.spawn([sys.executable, "-c", "print('bad flag --nope'); raise SystemExit(3)"], dict(os.environ))

    async def never_ready(remaining: float):
        return "no answer"

    with pytest.raises(ServerStartupError) as err:
        await server.wait_ready(never_ready, 10.0)
    assert "exited with code 3" in str(err.value) and "bad flag --nope" in str(err.value)
    exits: list[str] = []
    server.watch(exits.append)
    await _until(lambda: bool(exits))
    assert "exited with code 3" in exits[0]
    server.remove_workdir()


def test_parent_guard_kills_a_server_whose_launching_process_was_sigkilled(tmp_path):
    """The guard runs in every server process: SIGKILL the process that launched a server (no
    shutdown, no atexit) and the server's whole group goes within a couple of seconds."""
    launcher = textwrap.dedent(
        """
        import os, sys, time
        from rollfleet.engines.http.process import ServerProcess
        server = ServerProcess("guard-0", "test server")
        server.spawn([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
        print(server.pid, server.workdir, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    workdir = ""
    try:
        pid, workdir = proc.stdout.readline().split()
        server_pid = int(pid)
        time.sleep(0.5)  # let the server's interpreter start its guard
        assert _alive(server_pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


async def test_a_control_call_whose_connect_timed_out_is_sent_once_more():
    """A connect that timed out never reached the server (a starved machine): the control call is
    sent again, once; a second timeout is the typed error."""
    from rollfleet.engines.http.link import ServerLink

    class Clients:
        def __init__(self, timeouts: int) -> None:
            self.timeouts = timeouts
            self.calls = 0

        async def request(self, method: str, path: str, **kw: object) -> httpx.Response:
            self.calls += 1
            if self.calls <= self.timeouts:
                raise httpx.ConnectTimeout("starved")
            return httpx.Response(200, json={"ok": True})

    link = ServerLink("vllm-0", "vLLM server", request_timeout_s=5, control_timeout_s=5)
    link.clients = Clients(timeouts=1)  # type: ignore[assignment]
    resp = await link.request("POST", "/update_weights", op="commit_weights")
    assert resp.status_code == 200 and link.clients.calls == 2  # type: ignore[attr-defined]
    link.clients = Clients(timeouts=2)  # type: ignore[assignment]
    with pytest.raises(ReplicaUnavailable, match="commit_weights"):
        await link.request("POST", "/update_weights", op="commit_weights")
    assert link.clients.calls == 2  # type: ignore[attr-defined]


class _KeepAliveCloser:
    """A raw HTTP/1.1 server that answers each connection's first request and then, as uvicorn does
    when its event loop was held up past the keep-alive, closes the connection under the next
    request without reading it; with ``every``, it answers nothing at all."""

    def __init__(self, every: bool = False) -> None:
        self.every = every
        self.connections = 0
        self.answered: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.every or served:
                    return  # closed under the request: no byte of an answer
                self.answered.append(head.split(b"\r\n", 1)[0])
                writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{"ok":true}')
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def test_a_control_call_whose_keep_alive_connection_was_closed_under_it_is_sent_once_more():
    """A server that closed a pooled connection under a control call never read the call: it is
    sent again, once, on a fresh connection; a server that answers nothing is still an error."""
    from rollfleet.engines.http.link import ServerLink
    from rollfleet.engines.http.transport import HTTPClients

    for every in (False, True):
        fake = _KeepAliveCloser(every)
        server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = ServerLink("vllm-0", "vLLM server", request_timeout_s=5, control_timeout_s=5)
        link.clients = HTTPClients(f"http://127.0.0.1:{port}", request_timeout_s=5, control_timeout_s=5)
        try:
            if not every:
                first = await link.request("GET", "/metrics", op="load")  # leaves its connection pooled
                second = await link.request("POST", "/pause", op="pause", params={"mode": "abort"})
                assert first.status_code == second.status_code == 200
                assert fake.answered == [b"GET /metrics HTTP/1.1", b"POST /pause?mode=abort HTTP/1.1"]
                assert fake.connections == 2  # the pause went out again on a fresh connection
            else:
                with pytest.raises(ReplicaUnavailable, match="pause") as caught:
                    await link.request("POST", "/pause", op="pause")
                assert "without sending a response" in str(caught.value)
                assert fake.connections == 2  # once more, not forever
        finally:
            await link.clients.close()
            server.close()
            await server.wait_closed()
