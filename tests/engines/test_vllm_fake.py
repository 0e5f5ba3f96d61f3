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

import pytest
import pytest_asyncio

import rollfleet.engines.http.engine as http_engine
from rollfleet.engines.vllm import VLLMEngine
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported, ReplicaUnavailable

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


@pytest.mark.asyncio
async def test_a_keep_alive_connection_closed_by_the_server_is_retried_once_under_a_new_id():
    """vLLM drops idle keep-alive connections after 5 s; a request written into one as it closes
    must not fail (it used to quarantine the replica for seconds): it is sent again, once."""
    seen: list[str] = []
    completion = (b'{"choices":[{"token_ids":[7,8,9],"logprobs":{"token_logprobs":[-0.1,-0.2,-0.3]},'
                  b'"finish_reason":"length"}],"usage":{}}')  # fmt: skip

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        path = lines[0].split()[1]
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
        await reader.readexactly(int(headers.get("content-length", "0")))
        if path == "/v1/completions":
            seen.append(headers.get("x-request-id", ""))
            if len(seen) == 1:  # the first one lands on a connection the server is closing
                writer.close()
                return
        body = completion if path == "/v1/completions" else b"{}"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    eng = attached(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    await eng.start()
    try:
        out = await eng.generate("s1", [1, 2, 3], {"max_tokens": 3})
        assert out.token_ids == [7, 8, 9] and out.stop_reason == "length"
        assert len(seen) == 2 and seen[1] == seen[0] + "~r"
        assert len(eng._table) == 0 and eng.stats()["num_errors"] == 0
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


class LaunchedFakeVLLM(VLLMEngine):
    """vLLM's launch path, with the fake server as the launched process (the real command is kept)."""

    def _command(self) -> list[str]:
        self.real_command = super()._command()
        fake = Path(__file__).with_name("fake_vllm.py")
        return [
            sys.executable,
            str(fake),
            "--host",
            self.bind_host,
            "--port",
            str(self.port),
            "--vocab-size",
            str(VOCAB),
        ]


@pytest.mark.asyncio
async def test_a_launched_server_gets_its_work_dir_guard_and_watcher(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    eng = LaunchedFakeVLLM(str(tmp_path), max_model_len=256, device="cpu", startup_timeout_s=30.0)
    await eng.start()
    try:
        workdir = eng.workdir
        assert eng.limits().vocab_size == VOCAB and eng.address() == f"http://127.0.0.1:{eng.port}"
        cmd = eng.real_command
        assert cmd[cmd.index("--port") + 1] == str(eng.port) and cmd[cmd.index("--model") + 1] == str(tmp_path)
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
