"""The contract every HTTP engine shares, tested once for both (``vllm`` and ``sglang``), each against
its fake server on a real socket: what lives in ``rollfleet.engines.http`` behaves the same whoever
the server is."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from rollfleet.engines.http import HTTPEngine
from rollfleet.engines.sglang import SGLangEngine
from rollfleet.engines.vllm import VLLMEngine
from rollfleet.errors import EngineDead, ReplicaUnavailable

try:
    from tests.engines.fake_server import wait_until
    from tests.engines.fake_sglang import FakeSGLangServer
    from tests.engines.fake_vllm import FakeVLLMServer
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_server import wait_until
    from fake_sglang import FakeSGLangServer
    from fake_vllm import FakeVLLMServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VOCAB = 1000
PROMPT = [11, 12, 13]
#: Per engine: its fake, how to attach to it, and the routes the contract goes through.
ENGINES = {
    "vllm": dict(
        fake=lambda: FakeVLLMServer(vocab_size=VOCAB, max_model_len=256),
        engine=lambda url: VLLMEngine("tiny", base_url=url, max_model_len=256, vocab_size=VOCAB, device="cpu",
                                      startup_timeout_s=5.0, request_timeout_s=10.0),
        generate="/v1/completions", abort="/abort_requests", pause=("/pause", None), resume=("/resume", None),
    ),
    "sglang": dict(
        fake=lambda: FakeSGLangServer(vocab_size=VOCAB, context_length=256),
        engine=lambda url: SGLangEngine(model="fake/model", base_url=url, vocab_size=VOCAB, startup_timeout_s=5.0,
                                        request_timeout_s=10.0),
        generate="/generate", abort="/abort_request", pause=("/pause_generation", {"mode": "abort"}),
        resume=("/continue_generation", {}),
    ),
}  # fmt: skip


@pytest.fixture(params=sorted(ENGINES))
def kind(request) -> str:
    return request.param


@pytest.fixture
def fake(fake_servers, kind):
    server = fake_servers(kind)
    yield server.reset()
    server.release_all()  # never leave a test's held requests hanging


@pytest_asyncio.fixture
async def engine(fake, kind):
    eng = ENGINES[kind]["engine"](fake.url)
    await eng.start()
    yield eng
    await eng.shutdown()


def long_request(engine: HTTPEngine, request_id: str) -> asyncio.Task:
    return asyncio.create_task(engine.generate(request_id, PROMPT, {"max_tokens": 400}))


@pytest.mark.asyncio
async def test_pause_aborts_in_flight_and_holds_new_requests_until_resume(kind, fake, engine):
    fake.token_delay_s = 0.01
    first = long_request(engine, "p1")
    await wait_until(lambda: len(fake.running) == 1 and all(len(s["tokens"]) >= 3 for s in fake.running.values()))
    await engine.pause()
    assert first.done()  # pause returns once the in-flight request is back
    out = first.result()
    assert out.stop_reason == "aborted" and 3 <= len(out.token_ids) < 400 and len(out.log_probs) == len(out.token_ids)
    path, body = ENGINES[kind]["pause"]
    assert fake.bodies(path) == [body]
    fake.token_delay_s = 0.0
    held = asyncio.create_task(engine.generate("p2", PROMPT, {"max_tokens": 6}))
    await asyncio.sleep(0.1)
    assert not held.done() and len(fake.bodies(ENGINES[kind]["generate"])) == 1  # never reached the server
    assert (await engine.load()).waiting == 1  # held here, counted as waiting
    await engine.resume()
    out2 = await asyncio.wait_for(held, 5)
    assert out2.stop_reason == "length" and len(out2.token_ids) == 6
    path, body = ENGINES[kind]["resume"]
    assert fake.bodies(path) == [body]


@pytest.mark.asyncio
async def test_abort_releases_a_request_held_by_pause(kind, fake, engine):
    await engine.pause()
    held = asyncio.create_task(engine.generate("h", PROMPT, {"max_tokens": 6}))
    await asyncio.sleep(0.05)
    assert await engine.abort_all() == 1
    out = await asyncio.wait_for(held, 2)
    assert out.stop_reason == "aborted" and out.token_ids == []
    assert fake.bodies(ENGINES[kind]["generate"]) == []
    await engine.resume()


@pytest.mark.asyncio
async def test_cancelled_generate_is_aborted_on_the_server(kind, fake, engine):
    fake.token_delay_s = 0.05  # 20 s of work: only the abort ends it within the test
    task = long_request(engine, "gone")
    await wait_until(lambda: bool(fake.running), timeout=10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: not fake.running, timeout=10)  # the server stopped working on it
    assert fake.bodies(ENGINES[kind]["abort"]) and engine.stats()["num_aborted"] == 0


@pytest.mark.asyncio
async def test_a_server_that_goes_away_is_engine_dead_fast(kind):
    with ENGINES[kind]["fake"]() as own:
        eng = ENGINES[kind]["engine"](own.url)
        await eng.start()
        assert (await eng.health()).healthy
        assert (await eng.generate("x", PROMPT, {"max_tokens": 2})).stop_reason == "length"
    health = await eng.health()
    assert not health.healthy and health.detail
    t0 = time.monotonic()
    with pytest.raises(EngineDead) as err:
        await eng.generate("y", PROMPT, {"max_tokens": 2})
    assert time.monotonic() - t0 < 5 and err.value.retryable
    assert not (await eng.health()).healthy
    await eng.shutdown()
    with pytest.raises(ReplicaUnavailable, match="shut down"):
        await eng.generate("z", PROMPT, {"max_tokens": 2})
