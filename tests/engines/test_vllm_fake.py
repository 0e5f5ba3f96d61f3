"""Contract tests of the vLLM engine against a fake vLLM server (real sockets, no vLLM), reached
through ``base_url``: the wire format and every control path, grouped by plane. What every HTTP
engine shares (pause, abort of held requests, a server that goes away, cancellation) is tested for
both engines in ``test_http_engines.py``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import rollfleet.engines.http.engine as http_engine
from rollfleet.engines.vllm import VLLMEngine
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported, ReplicaUnavailable
from rollfleet.types import TokenOutput

try:
    from tests.engines.fake_vllm import PROMPT, VOCAB, FakeVLLMServer, expected_tokens, token_logprob, wait_until
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_vllm import PROMPT, VOCAB, FakeVLLMServer, expected_tokens, token_logprob, wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def attached(url: str, **kw) -> VLLMEngine:
    kw = {"max_model_len": 256, "vocab_size": VOCAB, "startup_timeout_s": 5.0, "request_timeout_s": 10.0,
          "device": "cpu", **kw}  # fmt: skip
    return VLLMEngine("tiny", base_url=url, **kw)


@pytest.fixture
def fake(fake_servers):
    server = fake_servers("vllm")
    yield server.reset()
    server.release_all()  # never leave a test's held requests hanging


@pytest_asyncio.fixture
async def engine(fake):
    eng = attached(fake.url)
    await eng.start()
    yield eng
    await eng.shutdown()


def long_request(engine: VLLMEngine, request_id: str, n: int = 400) -> asyncio.Task:
    return asyncio.create_task(engine.generate(request_id, PROMPT, {"max_tokens": n}))


def running_with_tokens(fake: FakeVLLMServer, count: int = 1, tokens: int = 2):
    return lambda: len(fake.running) >= count and all(len(s["tokens"]) >= tokens for s in fake.running.values())


# ---------------------------------------------------------------------------------------- lifecycle


@pytest.mark.asyncio
async def test_attach_reads_limits_and_reports_health(fake, engine):
    assert engine.address() == fake.url and engine.pid is None
    assert engine.limits().vocab_size == VOCAB and engine.limits().max_model_len == 256
    assert (await engine.health()).healthy
    await engine.start()  # already serving: nothing happens
    stats = engine.stats()
    assert stats["num_finished"] == 0 and "vllm_pid" not in stats


@pytest.mark.asyncio
async def test_start_against_nothing_fails_fast_with_a_typed_error():
    with FakeVLLMServer(vocab_size=VOCAB) as gone:
        url = gone.url
    eng = attached(url, startup_timeout_s=0.5)
    with pytest.raises(EngineDead, match="not ready"):
        await eng.start()
    with pytest.raises(ReplicaUnavailable):
        eng.limits()


# ---------------------------------------------------------------------------------------- data plane


@pytest.mark.asyncio
async def test_generate_sends_the_documented_body_and_parses_tokens_and_logprobs(fake, engine):
    sp = {"max_tokens": 7, "temperature": 0.0, "top_k": -1, "seed": None, "logprobs": True, "n": 4, "ignore_eos": True}
    out = await engine.generate("ünï cödé/ id", PROMPT, sp, priority=3, multi_modal_data=None)
    (body,) = fake.bodies("/v1/completions")
    assert body["prompt"] == PROMPT and body["max_tokens"] == 7 and body["model"] == "tiny"
    assert body["n"] == 1 and body["logprobs"] == 0 and body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True and body["priority"] == 3 and "seed" not in body
    assert fake.headers[0]["x-request-id"] == "_n__c_d___id~0"  # header-safe, unique per call
    assert out.token_ids == expected_tokens(PROMPT, 7, vocab_size=VOCAB)
    assert out.log_probs == [token_logprob(t) for t in out.token_ids]
    assert out.stop_reason == "length" and out.extra_fields["cached_tokens"] == 0
    stop_id = out.token_ids[2]
    stopped = await engine.generate("s", PROMPT, {"max_tokens": 10, "stop_token_ids": [stop_id]})
    assert stopped.stop_reason == "stop" and stopped.token_ids == out.token_ids[:3]
    assert stopped.extra_fields["vllm_stop_reason"] == stop_id
    with pytest.raises(InvalidRequest) as err:
        await engine.generate("mm", PROMPT, {"max_tokens": 2}, multi_modal_data={"image": 1})
    assert err.value.field == "multi_modal_data"


@pytest.mark.asyncio
async def test_bad_input_is_invalid_request_naming_the_field_and_server_errors_are_retryable(fake, engine):
    cases = [
        ([5, VOCAB + 9], {}, "prompt_ids"),
        ([5] * 300, {}, "prompt_ids"),
        (PROMPT, {"temperature": -1.0}, "sampling_params.temperature"),
    ]
    for prompt, extra, field in cases:
        with pytest.raises(InvalidRequest) as err:
            await engine.generate("bad", prompt, {"max_tokens": 2, **extra})
        assert err.value.field == field
    fake.fail_status = 500
    with pytest.raises(ReplicaUnavailable) as err:
        await engine.generate("boom", PROMPT, {"max_tokens": 2})
    assert type(err.value) is ReplicaUnavailable and "HTTP 500" in err.value.reason
    fake.fail_status = None
    assert (await engine.generate("ok", PROMPT, {"max_tokens": 2})).stop_reason == "length"
    assert engine.stats()["num_errors"] == 4


@pytest.mark.asyncio
async def test_finish_reasons_the_server_does_not_explain(fake, engine):
    fake.drop_finish_reason = True
    assert (await engine.generate("m1", PROMPT, {"max_tokens": 4})).stop_reason == "length"
    seq = expected_tokens(PROMPT, 10, vocab_size=VOCAB)
    out = await engine.generate("m2", PROMPT, {"max_tokens": 10, "stop_token_ids": [seq[2]]})
    assert out.stop_reason == "aborted" and out.token_ids == seq[:3]  # kept, resumable


@pytest.mark.asyncio
async def test_abort_one_and_all_return_partial_tokens(fake, engine):
    fake.token_delay_s = 0.01
    a, b, c = (long_request(engine, rid) for rid in ("A", "B", "C"))
    await wait_until(running_with_tokens(fake, 3, 3))
    await engine.abort("A")
    out_a = await asyncio.wait_for(a, 5)
    assert out_a.stop_reason == "aborted" and 3 <= len(out_a.token_ids) < 400
    assert len(out_a.log_probs) == len(out_a.token_ids)
    assert fake.bodies("/abort_requests")[0] == {"request_ids": ["cmpl-A~0-0"]}
    assert await engine.abort_all() == 2
    assert all(o.stop_reason == "aborted" for o in await asyncio.wait_for(asyncio.gather(b, c), 5))
    assert sorted(fake.bodies("/abort_requests")[1]["request_ids"]) == ["cmpl-B~1-0", "cmpl-C~2-0"]
    assert await engine.abort_all() == 0
    await engine.abort("unknown-id")  # ignored
    assert engine.stats()["num_aborted"] == 3


@pytest.mark.asyncio
async def test_an_abort_that_misses_a_request_still_on_the_wire_is_sent_again(fake, engine):
    fake.token_delay_s, fake.register_delay_s = 0.01, 0.3
    task = long_request(engine, "W")
    await wait_until(lambda: len(fake.headers) == 1)  # arrived, not registered yet: the abort misses it
    await engine.abort("W")
    out = await asyncio.wait_for(task, 5)
    assert out.stop_reason == "aborted" and len(out.token_ids) < 400
    assert len(fake.bodies("/abort_requests")) >= 2


async def _server_closing_the_first(route: str, body: bytes, kind: bytes) -> tuple[asyncio.Server, list[str], str]:
    """A raw HTTP server that closes the connection under the first request to ``route`` (as a
    server closing an idle keep-alive connection does) and answers ``body`` after; ``{}`` to any
    other route. Returns the server, the ``X-Request-Id`` of each request to ``route``, its URL."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        path = lines[0].split()[1]
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
        await reader.readexactly(int(headers.get("content-length", "0")))
        if path == route:
            seen.append(headers.get("x-request-id", ""))
            if len(seen) == 1:  # the first one lands on a connection the server is closing
                writer.close()
                return
        answer, answer_kind = (body, kind) if path == route else (b"{}", b"application/json")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (answer_kind, len(answer), answer)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


_COMPLETION = (b'{"choices":[{"token_ids":[7,8,9],"logprobs":{"token_logprobs":[-0.1,-0.2,-0.3]},'
               b'"finish_reason":"length"}],"usage":{}}')  # fmt: skip
_STREAM = (b'data: {"choices":[{"token_ids":[7,8],"logprobs":{"content":[{"logprob":-0.1},{"logprob":-0.2}]}}]}\n\n'
           b'data: {"choices":[{"token_ids":[9],"logprobs":{"content":[{"logprob":-0.3}]},"finish_reason":"length",'
           b'"weight_versions":[{"version":"default","start":0,"end":3}]}]}\n\ndata: [DONE]\n\n')  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
async def test_a_keep_alive_connection_closed_by_the_server_is_retried_once_under_a_new_id(streamed):
    """vLLM drops idle keep-alive connections after 5 s; a request written into one as it closes
    must not fail (it used to quarantine the replica for seconds): it is sent again, once. The
    same for a stream (vLLM's default generate path), which had no second try: a healthy replica
    under load was quarantined and its stream resumed elsewhere."""
    if streamed:
        server, seen, url = await _server_closing_the_first("/inference/v1/generate", _STREAM, b"text/event-stream")
        eng = attached(url, rl_routes=True)
    else:
        server, seen, url = await _server_closing_the_first("/v1/completions", _COMPLETION, b"application/json")
        eng = attached(url)
    await eng.start()
    try:
        if streamed:
            out = [item async for item in eng.generate_stream("s1", [1, 2, 3], {"max_tokens": 3})][-1]
        else:
            out = await eng.generate("s1", [1, 2, 3], {"max_tokens": 3})
        assert isinstance(out, TokenOutput) and out.token_ids == [7, 8, 9] and out.stop_reason == "length"
        assert len(seen) == 2 and seen[1] != seen[0] and seen[1].startswith("s1~")  # a new id
        assert len(eng._table) == 0 and eng.stats()["num_errors"] == 0
    finally:
        await eng.shutdown()
        server.close()


@pytest.mark.asyncio
async def test_a_stream_whose_server_never_answers_fails_typed_at_the_request_timeout():
    """A stream's request is sent apart from its reading, so that a stale connection can be tried
    again: a timeout while waiting for the answer must still be the replica's typed failure."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.decode().split()[1]
        if path == "/inference/v1/generate":
            await asyncio.sleep(30)  # hung: never a byte of the answer
        body = b"{}"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    eng = attached(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", rl_routes=True, request_timeout_s=0.5)
    await eng.start()
    try:
        with pytest.raises(ReplicaUnavailable):
            async for _ in eng.generate_stream("s1", [1, 2, 3], {"max_tokens": 3}):
                pass
        assert len(eng._table) == 0
    finally:
        await eng.shutdown()
        server.close()


# ---------------------------------------------------------------------------------------- pause / resume


@pytest.mark.asyncio
async def test_pause_also_aborts_a_request_that_reached_the_server_after_it_paused(fake, engine):
    fake.token_delay_s, fake.register_delay_s = 0.01, 0.3
    task = long_request(engine, "late")
    await wait_until(lambda: len(fake.headers) == 1)
    await engine.pause()
    out = await asyncio.wait_for(task, 5)
    assert out.stop_reason == "aborted" and out.token_ids == []
    assert {"request_ids": ["cmpl-late~0-0"]} in fake.bodies("/abort_requests")
    await engine.resume()


# ---------------------------------------------------------------------------------------- control plane


@pytest.mark.asyncio
async def test_update_weights_from_a_folder_a_file_and_a_state_dict(fake, engine, tmp_path):
    import torch
    from safetensors.torch import save_file

    before = await engine.generate("w0", PROMPT, {"max_tokens": 8})
    folder = tmp_path / "step_1"
    folder.mkdir()
    save_file({"lm_head.weight": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    await engine.update_weights(str(folder))
    rpc = fake.bodies("/collective_rpc")[-1]
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
    assert fake.loaded[-1] == ["lm_head.weight"] and fake.paths()[-1] == "/reset_prefix_cache"
    after = await engine.generate("w1", PROMPT, {"max_tokens": 8})
    assert after.token_ids != before.token_ids
    await engine.update_weights(str(folder / "model.safetensors"))  # a file: linked into a folder
    assert fake.loaded[-1] == ["lm_head.weight"]
    tied = torch.zeros(3)
    await engine.update_weights({"a.weight": tied, "b.weight": tied})  # in memory; tied storage is fine
    assert fake.loaded[-1] == ["a.weight", "b.weight"]
    with pytest.raises(ValueError):
        await engine.update_weights(str(tmp_path / "missing"))


@pytest.mark.asyncio
async def test_load_metrics_stats_and_clear_kv_cache(fake, engine):
    await engine.generate("c1", PROMPT, {"max_tokens": 2})
    await engine.generate("c2", PROMPT, {"max_tokens": 2})  # the same prompt: a prefix-cache hit
    metrics = await engine.metrics()
    assert metrics["vllm:prefix_cache_hits_total"] == len(PROMPT) and metrics["vllm:generation_tokens_total"] == 4
    assert not any(name.endswith("_bucket") for name in metrics)
    stats = engine.stats()
    assert stats["prefix_cache_hit_rate"] == 0.5 and stats["num_finished"] == 2 and stats["prompt_tokens"] == 6
    await engine.clear_kv_cache()
    assert "/reset_prefix_cache" in fake.paths()
    fake.token_delay_s = 0.01
    tasks = [long_request(engine, f"L{i}") for i in range(2)]
    await wait_until(running_with_tokens(fake, 2))
    load = await engine.load()
    assert load.running == 2 and load.waiting == 0 and load.inflight_tokens == 2 * (len(PROMPT) + 400)
    assert 0.0 < load.kv_usage < 1.0
    await engine.abort_all()
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_a_prefix_cache_reset_vllm_refuses_is_tried_again_then_fails_the_replica(fake, engine, monkeypatch):
    """vLLM answers 200 {"success": false} while blocks are held; that was taken as done, and an
    unsalted server went on serving KV the old weights computed after an abort-mode reload."""
    fake.refuse_resets = 2
    await engine.clear_kv_cache()  # the third try resets it
    assert fake.log.count("reset_prefix_cache") == 3 and fake.refuse_resets == 0
    monkeypatch.setattr("rollfleet.engines.vllm.engine.DRAIN_TIMEOUT_S", 0.3)
    fake.refuse_resets = 10**6
    with pytest.raises(ReplicaUnavailable, match="kept its prefix cache"):
        await engine.clear_kv_cache()  # attached, no RL routes: its requests are not salted
    # the reset after a weight load: refused there, it was dropped unread and the load reported done
    import torch

    with pytest.raises(ReplicaUnavailable, match="kept its prefix cache"):
        await engine.update_weights({"lm_head.weight": torch.ones(2, 2)})
    salted = attached(fake.url, rl_routes=True)
    await salted.start()
    try:
        await salted.clear_kv_cache()  # salted by the weights' label: stale blocks are never hit
    finally:
        await salted.shutdown()


@pytest.mark.asyncio
async def test_sleep_wake_up_and_profile_routes(fake, engine):
    with pytest.raises(NotSupported) as err:
        await engine.sleep()
    assert err.value.engine == "vllm" and err.value.op == "sleep"
    gpu = attached(fake.url, device="cuda")
    await gpu.start()
    try:
        await gpu.sleep()
        assert fake.sleeping and fake.bodies("/sleep") == [None]
        await gpu.wake_up()
        assert not fake.sleeping
        await gpu.start_profile(profile_prefix="p", unknown=1)
        assert fake.bodies("/start_profile") == [{"profile_prefix": "p"}]
        assert await gpu.stop_profile() is None  # attached: the server writes traces where it was told
        fake.profiler = False
        with pytest.raises(NotSupported):
            await gpu.start_profile()
    finally:
        await gpu.shutdown()


@pytest.mark.asyncio
async def test_a_server_too_starved_to_answer_health_is_busy_while_it_completes_requests(fake, engine, monkeypatch):
    """A CPU-starved vLLM answers /health late but still generates: reported healthy (busy) while
    it has work and completed a request within BUSY_GRACE_S, unhealthy once it stops completing."""
    engine.health_timeout_s = 0.2
    fake.health_delay_s = 1.0
    idle = await engine.health()
    assert not idle.healthy and "/health failed" in idle.detail  # nothing in flight: silence counts
    await engine.generate("done", PROMPT, {"max_tokens": 2})
    fake.token_delay_s = 0.01
    task = long_request(engine, "busy")
    await wait_until(running_with_tokens(fake))
    busy = await engine.health()
    assert busy.healthy and busy.detail.startswith("busy")
    monkeypatch.setattr(http_engine, "BUSY_GRACE_S", 0.0)  # no response for longer than the grace
    stuck = await engine.health()
    assert not stuck.healthy
    await engine.abort_all()
    await task


async def test_a_server_starved_as_it_gets_its_first_work_after_idling_is_busy_not_dead(fake, engine):
    """Busy time was counted from the last response, idle time included: an engine given work
    after starting, or after 30 s idle, was past its busy grace at once, so a /health timeout
    under load made it dead."""
    engine.health_timeout_s = 0.2
    fake.token_delay_s = 0.01
    fake.health_delay_s = 1.0
    engine._last_progress -= 3600.0  # an hour without a response: idle, not hung
    task = long_request(engine, "first")
    await wait_until(running_with_tokens(fake))
    busy = await engine.health()
    assert busy.healthy and busy.detail.startswith("busy")
    await engine.abort_all()
    await task


async def test_a_request_held_through_a_long_pause_is_busy_after_the_resume_not_dead(fake, rl):
    """Held while paused (a weight sync), the request kept the table non-empty, so the pause
    counted as busy time: past the grace, the first slow /health after the resume made it dead."""
    rl.health_timeout_s = 0.2
    fake.token_delay_s = 0.01
    await rl.pause()
    task = long_request(rl, "held")
    await asyncio.sleep(0.05)
    rl._last_progress -= 60.0  # a 60 s sync with the request held
    await rl.resume()
    await wait_until(running_with_tokens(fake))
    fake.health_delay_s = 1.0
    busy = await rl.health()
    assert busy.healthy and busy.detail.startswith("busy")
    await rl.abort_all()
    await task


class LaunchedFakeVLLM(VLLMEngine):
    """vLLM's launch path, with the fake server as the launched process (the real command is kept)."""

    def _command(self) -> list[str]:
        self.real_command = super()._command()
        fake = Path(__file__).with_name("fake_vllm.py")
        listen = (
            ["--uds", self.socket_path] if self.socket_path else ["--host", self.bind_host, "--port", str(self.port)]
        )
        return [sys.executable, str(fake), *listen, "--vocab-size", str(VOCAB)]


def launched(model_dir: Path, **kw) -> LaunchedFakeVLLM:
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return LaunchedFakeVLLM(str(model_dir), max_model_len=256, device="cpu", startup_timeout_s=30.0, **kw)


@pytest.mark.asyncio
@pytest.mark.parametrize("listen", ["unix", "tcp"])
async def test_a_launched_server_gets_its_work_dir_guard_and_watcher(tmp_path, listen):
    eng = launched(tmp_path, listen=listen)
    await eng.start()
    try:
        workdir = eng.workdir
        cmd = eng.real_command
        if listen == "tcp":
            assert eng.address() == f"http://127.0.0.1:{eng.port}" and eng.socket_path is None
            assert cmd[cmd.index("--port") + 1] == str(eng.port) and "--uds" not in cmd
        else:
            assert eng.port is None and eng.socket_path == str(workdir / "server.sock")
            assert cmd[cmd.index("--uds") + 1] == eng.socket_path and "--port" not in cmd and "--host" not in cmd
        assert eng.limits().vocab_size == VOCAB and cmd[cmd.index("--model") + 1] == str(tmp_path)
        profiler = json.loads(cmd[cmd.index("--profiler-config") + 1])
        assert profiler["torch_profiler_dir"] == str(workdir / "profiles")
        assert (workdir / "site" / "sitecustomize.py").exists()  # the parent guard
        assert (await eng.generate("a", PROMPT, {"max_tokens": 3})).stop_reason == "length"
        os.kill(eng.pid, signal.SIGKILL)
        await wait_until(lambda: not eng.is_alive(), timeout=5)
        with pytest.raises(EngineDead, match="exited with code -9"):
            await eng.generate("b", PROMPT, {"max_tokens": 3})
    finally:
        await eng.shutdown()
    assert not workdir.exists()


@pytest.mark.asyncio
async def test_a_private_server_is_driven_by_its_engine_only_and_exports_metrics_and_health(tmp_path):
    """``listen: unix``: the server's socket is in a work dir no other user can enter, and what
    listens on TCP (the exporter at ``address()``) forwards GET /metrics and /health, nothing else."""
    import httpx

    eng = launched(tmp_path)
    await eng.start()
    try:
        assert oct(os.stat(eng.workdir).st_mode & 0o777) == "0o700"
        assert Path(eng.socket_path).parent == eng.workdir
        url = eng.address()
        assert url.startswith("http://127.0.0.1:") and eng.port is None
        await eng.generate("a", PROMPT, {"max_tokens": 3})
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
            assert metrics.headers["content-type"].startswith("text/plain")
            assert (await http.get("/health")).status_code == 200
            for method, path in [("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"),
                                 ("GET", "/v1/models"), ("POST", "/inference/v1/generate"), ("POST", "/metrics"),
                                 ("GET", "/metrics/../pause"), ("POST", "/update_weights")]:  # fmt: skip
                status = (await http.request(method, path, json={})).status_code
                assert status in (404, 405), (method, path, status)
            # Had /pause reached the server, it would hold this one.
            assert (await asyncio.wait_for(eng.generate("b", PROMPT, {"max_tokens": 3}), 5)).stop_reason == "length"
            os.kill(eng.pid, signal.SIGKILL)
            await wait_until(lambda: not eng.is_alive(), timeout=5)
            assert (await http.get("/health")).status_code == 503  # the server is gone, the exporter says so
    finally:
        await eng.shutdown()
    async with httpx.AsyncClient(timeout=2) as http:
        with pytest.raises(httpx.ConnectError):  # the exporter went with it
            await http.get(f"{url}/health")


# ---------------------------------------------------------------------------------------- RL routes
# A server rollfleet launches has vLLM's RL API (``--enable-scale-out``, ``--weight-transfer-config``):
# generation through /inference/v1/generate, two-phase weight updates. ``rl_routes=True`` says so of
# the attached fake.


def rl_engine(fake: FakeVLLMServer, tmp_path: Path, key: str = "fleet", **kw) -> VLLMEngine:
    return attached(fake.url, rl_routes=True, stage_dir=str(tmp_path / "stage"), stage_key=key, **kw)


@pytest_asyncio.fixture
async def rl(fake, tmp_path):
    eng = rl_engine(fake, tmp_path)
    await eng.start()
    yield eng
    await eng.shutdown()


def state_dict(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"lm_head.weight": torch.randn(4, 3, generator=g), "model.norm.weight": torch.randn(3, generator=g)}


async def stage_and_commit(engine: VLLMEngine, version: int, mode: str = "keep") -> None:
    await engine.stage_weights(state_dict(version), version)
    await engine.commit_weights(version, mode)


@pytest.mark.asyncio
async def test_rl_generate_sends_token_ids_salted_with_the_weight_label_and_parses_each_tokens_version(fake, rl):
    assert rl.update_modes == {"abort", "keep"} and rl.weight_label == "default"
    sp = {"max_tokens": 7, "temperature": 0.0, "seed": None, "logprobs": True, "n": 4, "ignore_eos": True}
    out = await rl.generate("ünï cödé/ id", PROMPT, sp, priority=3, multi_modal_data=None)
    (body,) = fake.bodies("/inference/v1/generate")
    assert body["token_ids"] == PROMPT and body["priority"] == 3 and body["cache_salt"] == "default"
    assert body["stream"] is False and body["output_mode"] == "tokens"
    assert body["sampling_params"] == {"max_tokens": 7, "temperature": 0.0, "ignore_eos": True, "n": 1, "logprobs": 0,
                                       "detokenize": False}  # fmt: skip
    assert fake.headers[0]["x-request-id"] == "_n__c_d___id~0"
    assert out.token_ids == expected_tokens(PROMPT, 7, vocab_size=VOCAB)
    assert out.log_probs == [token_logprob(t) for t in out.token_ids]
    assert out.stop_reason == "length" and out.extra_fields["cached_tokens"] == 0
    assert out.token_versions == [None] * 7  # the boot weights: the replica knows their version
    stop_id = out.token_ids[2]
    stopped = await rl.generate("s", PROMPT, {"max_tokens": 10, "stop_token_ids": [stop_id], "stop": ["</s>"]})
    assert stopped.stop_reason == "stop" and stopped.token_ids == out.token_ids[:3]
    assert stopped.extra_fields["vllm_stop_reason"] == stop_id
    assert "detokenize" not in fake.bodies("/inference/v1/generate")[1]["sampling_params"]  # stop strings need text
    await stage_and_commit(rl, 1)
    labelled = await rl.generate("v", PROMPT, {"max_tokens": 5})
    assert labelled.token_versions == [1] * 5 and fake.bodies("/inference/v1/generate")[-1]["cache_salt"] == "1"
    assert fake.bodies("/v1/completions") == []


@pytest.mark.asyncio
async def test_rl_bad_input_is_invalid_request_naming_the_field(fake, rl):
    cases = [
        ([5, VOCAB + 9], {}, "prompt_ids", [5, VOCAB + 9]),
        ([5] * 300, {}, "prompt_ids", [5] * 300),
        ([], {}, "prompt_ids", []),
        (PROMPT, {"temperature": -1.0}, "sampling_params.temperature", -1.0),
    ]
    for prompt, extra, field, value in cases:
        with pytest.raises(InvalidRequest) as err:
            await rl.generate("bad", prompt, {"max_tokens": 2, **extra})
        assert err.value.field == field and err.value.value == value
    fake.fail_status = 500
    with pytest.raises(ReplicaUnavailable) as err:
        await rl.generate("boom", PROMPT, {"max_tokens": 2})
    assert type(err.value) is ReplicaUnavailable and "HTTP 500" in err.value.reason
    fake.fail_status = None
    assert (await rl.generate("ok", PROMPT, {"max_tokens": 2})).stop_reason == "length"
    with pytest.raises(InvalidRequest) as err:
        await rl.generate("mm", PROMPT, {"max_tokens": 2}, multi_modal_data={"image": 1})
    assert err.value.field == "multi_modal_data"


@pytest.mark.asyncio
async def test_rl_abort_and_pause_use_vllms_generate_ids_and_return_partial_tokens(fake, rl):
    fake.token_delay_s = 0.01
    a, b, c = (long_request(rl, rid) for rid in ("A", "B", "C"))
    await wait_until(running_with_tokens(fake, 3, 3))
    await rl.abort("A")
    out_a = await asyncio.wait_for(a, 5)
    assert out_a.stop_reason == "aborted" and 3 <= len(out_a.token_ids) < 400
    assert len(out_a.log_probs) == len(out_a.token_ids)
    assert fake.bodies("/abort_requests")[0] == {"request_ids": ["generate-tokens-A~0"]}
    await rl.pause()  # mode=abort: both come back with what they made
    outs = await asyncio.wait_for(asyncio.gather(b, c), 5)
    assert all(o.stop_reason == "aborted" and 3 <= len(o.token_ids) < 400 for o in outs)
    assert fake.log[-1] == "pause mode=abort clear_cache=false"
    held = asyncio.create_task(rl.generate("h", PROMPT, {"max_tokens": 3}))
    await wait_until(lambda: rl._table.held() == 1)
    await rl.resume()
    assert (await asyncio.wait_for(held, 5)).stop_reason == "length"
    assert rl.stats()["num_aborted"] == 3


@pytest.mark.asyncio
async def test_staging_writes_a_state_dict_once_per_node_while_generating(fake, rl, tmp_path):
    from safetensors.torch import load_file

    fake.token_delay_s = 0.005
    running = long_request(rl, "R")
    await wait_until(running_with_tokens(fake))
    state = state_dict(7)
    await rl.stage_weights(state, 7)
    shared = tmp_path / "stage" / "fleet" / "v7.safetensors"
    assert rl.last_stage["written"] == shared.stat().st_size == rl.last_stage["bytes"] > 0
    loaded = load_file(str(shared))
    assert loaded.keys() == state.keys() and all((loaded[k] == state[k]).all() for k in state)
    assert not running.done() and fake.running  # generating all along: staging aborts nothing
    other = rl_engine(fake, tmp_path)  # a second replica of the fleet on this node
    await other.start()
    try:
        inode = shared.stat().st_ino
        await other.stage_weights(state, 7)
        assert other.last_stage["written"] == 0 and shared.stat().st_ino == inode  # reused, not rewritten
        assert shared.stat().st_nlink == 3  # the shared name and each replica's link
        await other.shutdown()
        assert shared.exists() and shared.stat().st_nlink == 2  # still ours
    finally:
        await other.shutdown()
    await rl.abort_all()
    out = await running
    assert out.stop_reason == "aborted" and rl.stats()["num_aborted"] == 1


@pytest.mark.asyncio
async def test_keep_commit_loads_between_pause_and_resume_and_a_request_lives_through_it(fake, rl, tmp_path):
    fake.token_delay_s = 0.005
    running = long_request(rl, "K", n=300)  # starts on the weights the server booted with
    await wait_until(running_with_tokens(fake, 1, 5))
    await stage_and_commit(rl, 1)
    link = rl.last_stage["files"][0]
    assert fake.log == ["pause mode=keep clear_cache=false", "start", f"update {link}", "finish 1", "resume"]
    assert fake.bodies("/finish_weight_update") == [{"weight_version": "1"}]
    assert fake.bodies("/update_weights") == [{"update_info": {"path": link}}]
    salt1 = fake.salt
    await wait_until(lambda: fake.running["generate-tokens-K~0"]["versions"].count("1") >= 5)
    await stage_and_commit(rl, 2)
    assert rl.last_commit["mode"] == "keep" and rl.last_commit["pause_s"] >= rl.last_commit["load_s"] > 0
    out = await asyncio.wait_for(running, 10)
    assert out.stop_reason == "length" and len(out.token_ids) == 300  # kept, not aborted
    versions = out.token_versions
    a, b = versions.index(1), versions.index(2)
    assert 5 <= a < b < 300 and versions == [None] * a + [1] * (b - a) + [2] * (300 - b)  # None: the boot weights
    assert out.token_ids[:a] == expected_tokens(PROMPT, a, vocab_size=VOCAB)
    assert out.token_ids[a:b] == expected_tokens([out.token_ids[a - 1]], b - a, salt=salt1, vocab_size=VOCAB)
    assert out.token_ids[b:] == expected_tokens([out.token_ids[b - 1]], 300 - b, salt=fake.salt, vocab_size=VOCAB)
    assert fake.crashed is None and rl.stats()["num_aborted"] == 0
    stage = tmp_path / "stage" / "fleet"
    assert sorted(p.name for p in stage.iterdir()) == ["v2.safetensors", f"v2.safetensors.{rl.stage.owner}"]


@pytest.mark.asyncio
async def test_a_keep_commit_is_one_call_where_the_server_has_the_commit_route(fake, rl):
    fake.reset(commit_route=True, token_delay_s=0.005)
    running = long_request(rl, "R", n=200)
    await wait_until(running_with_tokens(fake, 1, 5))
    await stage_and_commit(rl, 1)
    link = rl.last_stage["files"][0]
    assert fake.log == ["commit route", "finish 1"]  # no /pause, /start, /update, /resume calls
    assert fake.bodies("/rollfleet/commit") == [{"paths": [link], "weight_version": "1"}]
    assert rl.last_commit["commit"] == "route" and rl.weight_label == "1"
    out = await asyncio.wait_for(running, 10)
    assert out.stop_reason == "length" and len(out.token_ids) == 200  # kept, not aborted
    assert 1 in out.token_versions and out.token_versions[-1] == 1


@pytest.mark.asyncio
async def test_a_load_that_fails_in_the_commit_route_is_done_again_step_by_step_then_resumed(fake, rl):
    fake.reset(commit_route=True, fail_updates=1)
    await stage_and_commit(rl, 1)
    link = rl.last_stage["files"][0]
    # the route left the server paused and half-loaded: load again, only then resume
    assert fake.log == ["commit route", "start", f"update {link}", "finish 1", "resume"]
    assert rl.last_commit["commit"] == "route, then steps" and rl.weight_label == "1"
    out = await rl.generate("after", PROMPT, {"max_tokens": 3})
    assert out.token_versions == [1, 1, 1]


@pytest.mark.asyncio
async def test_a_server_without_the_commit_route_is_asked_once(fake, rl):
    await stage_and_commit(rl, 1)
    await stage_and_commit(rl, 2)
    assert len(fake.bodies("/rollfleet/commit")) == 1  # the 404 is remembered
    assert fake.log.count("pause mode=keep clear_cache=false") == 2 and rl.last_commit["commit"] == "steps"


@pytest.mark.asyncio
async def test_a_request_that_arrives_during_a_keep_commit_waits_and_goes_out_with_the_new_salt(fake, rl):
    fake.update_delay_s = 0.3
    await rl.stage_weights(state_dict(3), 3)
    commit = asyncio.create_task(rl.commit_weights(3, "keep"))
    await wait_until(lambda: "start" in fake.log)
    late = asyncio.create_task(rl.generate("late", PROMPT, {"max_tokens": 4}))
    await wait_until(lambda: rl._table.held() == 1)
    assert not fake.bodies("/inference/v1/generate")  # held here while the weights load
    await commit
    out = await asyncio.wait_for(late, 5)
    assert out.token_versions == [3] * 4 and fake.bodies("/inference/v1/generate")[0]["cache_salt"] == "3"
    assert fake.log.index("resume") > fake.log.index("finish 3")


@pytest.mark.asyncio
async def test_prefix_cache_hits_within_a_version_and_never_across_a_keep_commit(fake, rl):
    for _ in range(2):
        last = await rl.generate("p", PROMPT, {"max_tokens": 2})
    assert last.extra_fields["cached_tokens"] == len(PROMPT)
    await stage_and_commit(rl, 4)  # keep: the server's cache is not cleared
    assert "reset_prefix_cache" not in fake.log
    assert (await rl.generate("p", PROMPT, {"max_tokens": 2})).extra_fields["cached_tokens"] == 0
    assert (await rl.generate("p", PROMPT, {"max_tokens": 2})).extra_fields["cached_tokens"] == len(PROMPT)


@pytest.mark.asyncio
async def test_abort_commit_loads_while_the_caller_holds_the_pause(fake, rl):
    await rl.pause()
    await rl.stage_weights(state_dict(5), 5)
    resumed = asyncio.create_task(rl.resume())  # sent too early: waits for the load to finish
    fake.update_delay_s = 0.2
    await rl.commit_weights(5, "abort")
    await resumed
    link = rl.last_stage["files"][0]
    assert fake.log == ["pause mode=abort clear_cache=false", "start", f"update {link}", "finish 5",
                        "reset_prefix_cache", "resume"]  # fmt: skip
    assert fake.crashed is None and rl.weight_label == "5"


@pytest.mark.asyncio
async def test_a_failed_load_is_retried_once_then_the_engine_is_dead_and_never_resumed(fake, rl):
    fake.fail_updates = 1
    await stage_and_commit(rl, 6)
    assert fake.log[:4] == ["pause mode=keep clear_cache=false", "start", fake.log[2], "start"]
    assert fake.log[-2:] == ["finish 6", "resume"]  # the 500 closed its connection: the retry used a fresh one
    fake.log.clear()
    fake.fail_updates = 2
    fake.token_delay_s = 0.005
    running = long_request(rl, "F")
    await wait_until(running_with_tokens(fake))
    await rl.stage_weights(state_dict(7), 7)
    with pytest.raises(EngineDead, match="half-loaded") as err:
        await rl.commit_weights(7, "keep")
    # the first failure, the real cause, is kept (the retry's is often only its echo)
    assert "failed twice (first: " in str(err.value) and isinstance(err.value.__cause__, ReplicaUnavailable)
    assert "resume" not in fake.log and fake.crashed is None  # the half-loaded model never ran
    assert not rl.is_alive() and not (await rl.health()).healthy
    with pytest.raises(EngineDead):
        await asyncio.wait_for(running, 5)
    with pytest.raises(EngineDead):
        await rl.resume()
    assert "resume" not in fake.log


@pytest.mark.asyncio
async def test_user_paths_are_used_where_they_are_and_never_removed(fake, rl, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for i in range(2):
        save_file(state_dict(i), str(folder / f"part-{i}.safetensors"))
    await rl.stage_weights(str(folder), 8)
    await rl.commit_weights(8, "keep")
    assert [b["update_info"]["path"] for b in fake.bodies("/update_weights")] == [
        str(folder / "part-0.safetensors"), str(folder / "part-1.safetensors")]  # fmt: skip
    assert fake.updates[-1] == ("8", sorted(state_dict()) * 2)
    await rl.stage_weights(str(folder / "part-1.safetensors"), 9)
    await rl.commit_weights(9, "abort")
    await rl.shutdown()
    assert sorted(p.name for p in folder.iterdir()) == ["part-0.safetensors", "part-1.safetensors"]
    with pytest.raises(KeyError):
        await rl.commit_weights(10, "keep")
    with pytest.raises(ValueError):
        await rl.stage_weights(str(tmp_path / "missing"), 10)


@pytest.mark.asyncio
async def test_shutdown_releases_the_stage_files_but_not_those_another_replica_still_links(fake, rl, tmp_path):
    other = rl_engine(fake, tmp_path)
    await other.start()
    await rl.stage_weights(state_dict(1), 1)
    await other.stage_weights(state_dict(1), 1)
    await rl.commit_weights(1, "keep")
    await rl.stage_weights(state_dict(2), 2)
    await rl.commit_weights(2, "keep")
    stage = tmp_path / "stage" / "fleet"
    assert (stage / "v1.safetensors").exists()  # the other replica has not moved on
    await rl.shutdown()
    assert sorted(p.name for p in stage.iterdir()) == ["v1.safetensors", f"v1.safetensors.{other.stage.owner}"]
    await other.shutdown()
    assert not stage.exists()


@pytest.mark.asyncio
async def test_update_weights_on_an_rl_server_labels_what_it_loaded_as_no_version(fake, rl):
    await stage_and_commit(rl, 3)
    await rl.update_weights(state_dict(1))
    rpc = fake.bodies("/collective_rpc")[-1]
    assert rpc["method"] == "reload_weights" and fake.loaded[-1] == sorted(state_dict())
    assert fake.bodies("/update_weight_version") == [{"new_version": "reload-1"}]
    out = await rl.generate("u", PROMPT, {"max_tokens": 3})
    assert out.token_versions is None and fake.bodies("/inference/v1/generate")[-1]["cache_salt"] == "reload-1"
    assert not os.listdir(Path(rpc["kwargs"]["weights_path"]).parent / "fleet")  # nothing staged is left


@pytest.mark.asyncio
async def test_an_attached_server_without_rl_routes_commits_through_reload_weights(fake, engine, tmp_path):
    assert engine.update_modes == {"abort"}
    await engine.stage_weights(state_dict(1), 1)
    with pytest.raises(NotSupported):
        await engine.commit_weights(1, "keep")
    await engine.commit_weights(1, "abort")
    (rpc,) = fake.bodies("/collective_rpc")
    assert rpc["method"] == "reload_weights" and fake.loaded == [sorted(state_dict())]
    assert fake.paths()[-1] == "/reset_prefix_cache" and not fake.bodies("/start_weight_update")
    out = await engine.generate("c", PROMPT, {"max_tokens": 3})
    assert out.token_versions is None and len(fake.bodies("/v1/completions")) == 1
    await engine.shutdown()
    assert not engine.stage.path.exists()


@pytest.mark.asyncio
async def test_weights_checksum_digests_vllms_weight_checker_and_changes_with_a_commit(fake, rl, engine):
    before = await rl.weights_checksum()
    assert before is not None and before == await rl.weights_checksum()
    await stage_and_commit(rl, 1)
    after = await rl.weights_checksum()
    assert after is not None and after != before
    assert fake.bodies("/weight_checker")[-1] == {"action": "checksum"}
    assert await engine.weights_checksum() is None  # no RL routes: the engine cannot tell


async def test_a_streamed_request_aborted_at_the_gate_is_counted_as_aborted(fake, rl):
    """Held while paused and aborted there, a whole request counted in num_aborted and a
    streamed one did not."""

    async def drain(stream: Any) -> list[Any]:
        return [item async for item in stream]

    await rl.pause()
    whole = asyncio.ensure_future(rl.generate("whole", PROMPT, {"max_tokens": 5}))
    streamed = asyncio.ensure_future(drain(rl.generate_stream("streamed", PROMPT, {"max_tokens": 5})))
    await asyncio.sleep(0.2)
    await rl.abort("whole")
    await rl.abort("streamed")
    assert (await whole).stop_reason == "aborted" and (await streamed)[-1].stop_reason == "aborted"
    assert rl.stats()["num_aborted"] == 2
    await rl.resume()
