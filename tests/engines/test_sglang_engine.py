"""Contract tests of the SGLang engine against a fake SGLang HTTP server (real sockets). What every
HTTP engine shares (pause, abort of held requests, a server that goes away) is tested for both
engines in ``test_http_engines.py``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

from rollfleet.config import RolloutConfig
from rollfleet.engines.sglang import SGLangEngine, normalize_finish_reason, translate_sampling_params, wire
from rollfleet.errors import EngineDead, InvalidRequest, ReplicaUnavailable

try:
    from tests.engines.fake_server import wait_until
    from tests.engines.fake_sglang import FakeSGLangServer, expected_tokens, salt_for, token_logprob
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_server import wait_until
    from fake_sglang import FakeSGLangServer, expected_tokens, salt_for, token_logprob

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VOCAB = 1000
PROMPT = [11, 12, 13]


def make_config(url: str, **sglang) -> RolloutConfig:
    section = {"base_url": url, "vocab_size": VOCAB, "startup_timeout_s": 5.0, "request_timeout_s": 10.0}
    section.update(sglang)
    return RolloutConfig(name="sglang", model="fake/model", num_replicas=1, sglang=section)


@pytest.fixture(scope="module")
def shared_fake():
    server = FakeSGLangServer(vocab_size=VOCAB, context_length=256).start()
    yield server
    server.stop()


@pytest.fixture
def fake(shared_fake):
    """The module's fake server, reset to a fresh state (starting one per test costs ~0.3 s)."""
    yield shared_fake.reset()
    shared_fake.paused = False  # never leave a test's held requests hanging


@pytest_asyncio.fixture
async def engine(fake):
    eng = SGLangEngine.from_config(make_config(fake.url), replica_index=0)
    await eng.start()
    yield eng
    await eng.shutdown()


def socket_port():
    import contextlib
    import socket

    @contextlib.contextmanager
    def cm():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            yield s.getsockname()[1]

    return cm()


# ---------------------------------------------------------------------------------------- pure


def test_structured_outputs_become_sglangs_constraint_keys():
    def constraint(**so):
        out = translate_sampling_params({"max_tokens": 4, "structured_outputs": so})
        return {k: v for k, v in out.items() if k != "max_new_tokens"}

    assert constraint(json={"type": "object"}) == {"json_schema": '{"type": "object"}'}
    assert constraint(json_object=True) == {"json_schema": '{"type": "object"}'}
    assert constraint(regex="[0-9]+") == {"regex": "[0-9]+"}
    assert constraint(choice=["yes", "a.b"]) == {"regex": "yes|a\\.b"}
    assert constraint(grammar='root ::= "x"') == {"ebnf": 'root ::= "x"'}


def test_translate_sampling_params_does_not_mutate_and_renames():
    sp = {"max_tokens": 7, "seed": 3, "min_tokens": 1, "logprobs": 1, "n": 1, "foo": 2, "stop_token_ids": (5,)}
    before = dict(sp)
    out = translate_sampling_params(sp)
    assert sp == before
    assert out == {"max_new_tokens": 7, "sampling_seed": 3, "min_new_tokens": 1, "stop_token_ids": [5]}
    with pytest.raises(InvalidRequest) as err:
        translate_sampling_params({"max_tokens": 4, "n": 2})
    assert err.value.field == "sampling_params.n"
    for key, value in (("bad_words", ["no"]), ("allowed_token_ids", [1, 2])):  # vLLM's alone: were dropped
        with pytest.raises(InvalidRequest) as err:
            translate_sampling_params({"max_tokens": 4, key: value})
        assert err.value.field == f"sampling_params.{key}"


def test_normalize_finish_reason():
    assert normalize_finish_reason({"type": "stop", "matched": 2}, 3, 10) == "stop"
    assert normalize_finish_reason({"type": "length", "length": 10}, 10, 10) == "length"
    assert normalize_finish_reason({"type": "abort", "message": "Aborted"}, 4, 10) == "aborted"
    # Missing: budget used up -> length, otherwise aborted (resumable), never a silent "stop".
    assert normalize_finish_reason(None, 10, 10) == "length"
    assert normalize_finish_reason(None, 4, 10) == "aborted"
    assert normalize_finish_reason({}, 0, None) == "aborted"


def test_wire_parses_answers_errors_and_load():
    triples = [[-0.1, 5, None], [-0.2, 6, None]]
    out = wire.parse_generate(
        [
            {
                "output_ids": [5],
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": triples,
                    "cached_tokens": 2,
                },
            }
        ],
        2,
    )
    assert out.token_ids == [5, 6] and out.log_probs == [-0.1, -0.2]  # aligned on the logprob ids
    assert out.stop_reason == "length" and out.extra_fields["engine_cached_tokens"] == 2
    rejected = {
        "output_ids": [],
        "meta_info": {"finish_reason": {"type": "abort", "status_code": 400, "message": "top_p bad"}},
    }
    with pytest.raises(InvalidRequest) as err:
        wire.parse_generate(rejected, 4)
    assert err.value.field == "sampling_params.top_p"
    with pytest.raises(ValueError):
        wire.parse_generate("nope", 4)
    assert wire.field_from_message("x", "max_new_tokens") == "sampling_params.max_tokens"
    assert wire.field_from_message("The input (300 tokens) is longer than the model's context length") == "prompt_ids"
    assert wire.field_from_message("nothing known") == "request"
    assert wire.abort_bodies(["a", "b"], False) == [{"rid": "a"}, {"rid": "b"}]
    assert wire.abort_bodies(["a"], True) == [{"rid": "", "abort_all": True}]
    load = wire.load_from_metrics({"sglang:num_running_reqs": [1.0, 2.0], "sglang:token_usage": [0.2, 0.5]})
    assert load.running == 3 and load.kv_usage == 0.5
    assert wire.load_from_metrics({}) is None
    newer = wire.load_from_get_load(
        [{"num_running_reqs": 2, "num_waiting_reqs": 1, "num_tokens": 100, "num_pending_tokens": 75}]
    )
    assert (newer.running, newer.waiting, newer.inflight_tokens, newer.kv_usage) == (2, 1, 25, 0.25)


# ---------------------------------------------------------------------------------------- start


@pytest.mark.asyncio
async def test_start_reads_limits_and_vocab_from_config_json(fake, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 777, "max_position_embeddings": 8192}))
    fake.model_path = str(tmp_path)
    eng = SGLangEngine.from_config(make_config(fake.url, vocab_size=None), replica_index=3)
    await eng.start()
    try:
        limits = eng.limits()
        assert limits.vocab_size == 777
        assert limits.max_model_len == 256  # the server's context_length
        assert eng.address() == fake.url
        paths = fake.paths()
        assert "/health" in paths and "/get_model_info" in paths and "/get_server_info" in paths
    finally:
        await eng.shutdown()
    await eng.shutdown()  # idempotent


@pytest.mark.asyncio
async def test_start_against_nothing_fails_fast_with_typed_error():
    with socket_port() as port:
        pass  # bound and released: nothing listens there now
    eng = SGLangEngine.from_config(make_config(f"http://127.0.0.1:{port}", startup_timeout_s=0.5), 0)
    t0 = time.monotonic()
    with pytest.raises(EngineDead) as err:
        await eng.start()
    assert time.monotonic() - t0 < 5
    assert "not ready" in str(err.value)


# ---------------------------------------------------------------------------------------- generate


@pytest.mark.asyncio
async def test_a_callers_salt_and_priority_reach_sglang_and_other_extras_are_refused(fake, engine):
    """cache_salt and priority were dropped (debug log only): a caller's prefix-cache isolation did
    not apply on SGLang, where the vLLM adapter sends both; a keyword extra was dropped too."""
    from rollfleet.errors import InvalidRequest

    await engine.generate("salted", PROMPT, {"max_tokens": 2, "cache_salt": "tenant-a", "priority": 5})
    body = fake.bodies("/generate")[-1]
    assert body["extra_key"] == "\x00tenant-a" and body["priority"] == 5  # the boot weights' namespace, salted
    assert "cache_salt" not in body and "priority" not in body["sampling_params"]
    await engine.generate("kw", PROMPT, {"max_tokens": 2}, priority=7)
    assert fake.bodies("/generate")[-1]["priority"] == 7
    with pytest.raises(InvalidRequest, match="not supported by the sglang engine adapter"):
        await engine.generate("x", PROMPT, {"max_tokens": 2}, multi_modal_data={"image": "..."})
    with pytest.raises(InvalidRequest, match="an integer"):
        await engine.generate("y", PROMPT, {"max_tokens": 2}, priority="high")
    # a salt and a weight label never run together into another version's namespace
    engine._label = "1"
    await engine.generate("v1", PROMPT, {"max_tokens": 2})
    unsalted_v1 = fake.bodies("/generate")[-1]["extra_key"]
    engine._label = None
    await engine.generate("boot", PROMPT, {"max_tokens": 2, "cache_salt": "1"})
    assert fake.bodies("/generate")[-1]["extra_key"] != unsalted_v1


@pytest.mark.asyncio
async def test_generate_sends_exact_body_and_parses_tokens_and_logprobs(fake, engine):
    sp = {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 123,
        "stop_token_ids": [VOCAB + 5],  # never generated
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "logprobs": 1,  # vLLM-only: dropped
        "n": 1,
    }
    sp_before = json.loads(json.dumps(sp))
    out = await engine.generate("req-1", PROMPT, sp)
    assert sp == sp_before  # caller's dict untouched

    (body,) = fake.bodies("/generate")
    rid = body.pop("rid")
    assert rid.startswith("req-1@") and len(rid) == len("req-1@") + 32  # the caller's id, then the call's own
    assert body == {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 7,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "sampling_seed": 123,
            "stop_token_ids": [VOCAB + 5],
            "ignore_eos": True,
            "repetition_penalty": 1.1,
            "min_new_tokens": 2,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    assert out.token_ids == expected_tokens(PROMPT, 7, vocab_size=VOCAB)
    assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
    assert out.log_probs == [token_logprob(t) for t in out.token_ids]
    assert out.stop_reason == "length"
    assert out.extra_fields["engine_finish_reason"] == {"type": "length", "length": 7}


@pytest.mark.asyncio
async def test_stop_reasons_stop_length_abort_and_missing(fake, engine):
    seq = expected_tokens(PROMPT, 10, vocab_size=VOCAB)
    stop_id = seq[2]
    assert stop_id not in seq[:2]
    out = await engine.generate("s", PROMPT, {"max_tokens": 10, "stop_token_ids": [stop_id]})
    assert out.stop_reason == "stop" and out.token_ids == seq[:3]

    out = await engine.generate("l", PROMPT, {"max_tokens": 4})
    assert out.stop_reason == "length" and out.token_ids == seq[:4]

    fake.token_delay_s = 0.01
    task = asyncio.create_task(engine.generate("a", PROMPT, {"max_tokens": 500}))
    await wait_until(lambda: fake.request("a") is not None and len(fake.request("a")["tokens"]) >= 2)
    await engine.abort("a")
    out = await asyncio.wait_for(task, 5)
    assert out.stop_reason == "aborted"
    assert 2 <= len(out.token_ids) < 500 and len(out.log_probs) == len(out.token_ids)

    fake.token_delay_s = 0.0
    fake.drop_finish_reason = True
    assert (await engine.generate("m1", PROMPT, {"max_tokens": 4})).stop_reason == "length"
    out = await engine.generate("m2", PROMPT, {"max_tokens": 10, "stop_token_ids": [stop_id]})
    assert out.stop_reason == "aborted" and out.token_ids == seq[:3]


@pytest.mark.asyncio
async def test_abort_one_request_mid_generation_leaves_others(fake, engine):
    fake.token_delay_s = 0.01
    a = asyncio.create_task(engine.generate("A", PROMPT, {"max_tokens": 400}))
    b = asyncio.create_task(engine.generate("B", [5, 6], {"max_tokens": 30}))
    await wait_until(lambda: fake.request("A") is not None and len(fake.request("A")["tokens"]) >= 3)
    await engine.abort("A")
    out_a = await asyncio.wait_for(a, 5)
    assert out_a.stop_reason == "aborted"
    assert 3 <= len(out_a.token_ids) < 400
    assert out_a.token_ids == expected_tokens(PROMPT, len(out_a.token_ids), vocab_size=VOCAB)
    assert len(out_a.log_probs) == len(out_a.token_ids)
    assert [b["rid"].split("@")[0] for b in fake.bodies("/abort_request")] == ["A"]
    out_b = await asyncio.wait_for(b, 5)
    assert out_b.stop_reason == "length" and len(out_b.token_ids) == 30
    await engine.abort("unknown-id")  # ignored, no error


@pytest.mark.asyncio
async def test_abort_all_counts_and_uses_abort_all_route(fake, engine):
    fake.token_delay_s = 0.01
    tasks = [asyncio.create_task(engine.generate(f"r{i}", PROMPT, {"max_tokens": 400})) for i in range(3)]
    await wait_until(lambda: len(fake.running) == 3)
    assert await engine.abort_all() == 3
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(o.stop_reason == "aborted" for o in outs)
    assert {"rid": "", "abort_all": True} in fake.bodies("/abort_request")
    assert await engine.abort_all() == 0


@pytest.mark.asyncio
async def test_duplicate_request_ids_in_flight_get_distinct_rids(fake, engine):
    fake.token_delay_s = 0.005
    outs = await asyncio.gather(*(engine.generate("same", PROMPT, {"max_tokens": 5}) for _ in range(2)))
    assert all(o.stop_reason == "length" for o in outs)
    rids = [b["rid"] for b in fake.bodies("/generate")]
    assert len(set(rids)) == 2 and all(r.startswith("same@") for r in rids)


@pytest.mark.asyncio
async def test_aborting_a_request_leaves_one_whose_id_it_starts(fake, engine):
    """SGLang aborts every request whose rid starts with the one named: the rid was the caller's
    id, so aborting GRPO sibling ``row-1`` also ended ``row-10`` (and a request retried at once
    after a cancel was refused: its rid was still held)."""
    fake.token_delay_s = 0.01
    one = asyncio.create_task(engine.generate("row-1", PROMPT, {"max_tokens": 400}))
    ten = asyncio.create_task(engine.generate("row-10", [5, 6], {"max_tokens": 30}))
    await wait_until(lambda: fake.request("row-1") is not None and fake.request("row-10") is not None)
    await engine.abort("row-1")
    assert (await asyncio.wait_for(one, 5)).stop_reason == "aborted"
    assert (await asyncio.wait_for(ten, 5)).stop_reason == "length"


# ---------------------------------------------------------------------------------------- weights / cache / memory


@pytest.mark.asyncio
async def test_update_weights_from_disk_changes_outputs(fake, engine, tmp_path):
    import torch
    from safetensors.torch import save_file

    before = await engine.generate("w1", PROMPT, {"max_tokens": 8})
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))
    await engine.update_weights(str(ckpt))
    # one phase, no version: labelled so that no token of these weights passes for a version
    assert fake.bodies("/update_weights_from_disk") == [{"model_path": str(ckpt), "weight_version": "reload-1"}]
    assert fake.loads == [(str(ckpt), ["lm_head.weight"])] and fake.weight_version == "reload-1"
    after = await engine.generate("w2", PROMPT, {"max_tokens": 8})
    assert after.token_ids != before.token_ids
    assert after.token_ids == expected_tokens(PROMPT, 8, salt=salt_for(str(ckpt)), vocab_size=VOCAB)
    assert after.token_versions is None and fake.bodies("/generate")[-1]["extra_key"] == "reload-1"

    await engine.update_weights({"model_path": ckpt, "weight_version": "7"})
    assert fake.bodies("/update_weights_from_disk")[-1] == {"model_path": str(ckpt), "weight_version": "7"}

    with pytest.raises(InvalidRequest) as err:
        await engine.update_weights(str(tmp_path / "missing"))
    assert err.value.field == "weights" and "Failed to get weights iterator" in err.value.detail
    with pytest.raises(InvalidRequest) as err:  # a mapping that is no state dict
        await engine.update_weights({"lm_head.weight": [0.0, 1.0]})
    assert err.value.field == "weights"
    assert not list(engine.stage.path.glob("reload-*"))  # its scratch folder is gone


@pytest.mark.asyncio
async def test_clear_kv_cache_hits_flush_cache(fake, engine):
    await engine.clear_kv_cache()
    assert fake.paths().count("/flush_cache") == 1 and fake.flushes == 1


@pytest.mark.asyncio
async def test_sleep_and_wake_up_hit_memory_routes_and_hold_requests(fake, engine):
    fake.token_delay_s = 0.01
    running = asyncio.create_task(engine.generate("z1", PROMPT, {"max_tokens": 400}))
    await wait_until(lambda: fake.request("z1") is not None)
    await engine.sleep()
    assert (await asyncio.wait_for(running, 5)).stop_reason == "aborted"
    assert fake.bodies("/release_memory_occupation") == [{}] and fake.asleep

    fake.token_delay_s = 0.0
    held = asyncio.create_task(engine.generate("z2", PROMPT, {"max_tokens": 3}))
    await asyncio.sleep(0.1)
    assert not held.done()
    await engine.wake_up()
    assert fake.bodies("/resume_memory_occupation") == [{}] and not fake.asleep
    assert (await asyncio.wait_for(held, 5)).token_ids == expected_tokens(PROMPT, 3, vocab_size=VOCAB)


@pytest.mark.asyncio
async def test_profile_routes(fake, engine):
    await engine.start_profile(output_dir="/tmp/trace", num_steps=5)
    assert fake.bodies("/start_profile") == [{"output_dir": "/tmp/trace", "num_steps": 5}]
    assert await engine.stop_profile() == "/tmp/trace"
    assert "/stop_profile" in fake.paths()


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.asyncio
async def test_bad_requests_raise_invalid_request_with_field(fake, engine):
    with pytest.raises(InvalidRequest) as err:
        await engine.generate("e1", list(range(1, 300)), {"max_tokens": 4})
    assert err.value.field == "prompt_ids" and "context length" in err.value.detail
    with pytest.raises(InvalidRequest) as err:
        await engine.generate("e2", PROMPT, {"max_tokens": 4, "temperature": -1.0})
    assert err.value.field == "sampling_params.temperature"
    # the engine keeps serving
    assert (await engine.generate("e3", PROMPT, {"max_tokens": 2})).stop_reason == "length"


# ---------------------------------------------------------------------------------------- health / load


@pytest.mark.asyncio
async def test_load_from_metrics_and_get_load(fake, engine):
    fake.token_delay_s = 0.01
    tasks = [asyncio.create_task(engine.generate(f"L{i}", PROMPT, {"max_tokens": 400})) for i in range(2)]
    await wait_until(lambda: len(fake.running) == 2 and all(len(s["tokens"]) >= 2 for s in fake.running.values()))
    load = await engine.load()
    assert load.running == 2 and load.waiting == 0
    assert load.inflight_tokens >= 2 * (len(PROMPT) + 2)
    assert 0.0 < load.kv_usage < 1.0
    assert "/metrics" in fake.paths()

    fake.metrics_enabled = False
    fresh = SGLangEngine.from_config(make_config(fake.url), replica_index=1)
    await fresh.start()
    try:
        load2 = await fresh.load()
        assert load2.running == 2 and load2.waiting == 0 and load2.inflight_tokens >= 2 * (len(PROMPT) + 2)
        assert "/get_load" in fake.paths()
    finally:
        await fresh.shutdown()
    await engine.abort_all()
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_generate_before_start_is_a_typed_error(fake):
    eng = SGLangEngine.from_config(make_config(fake.url), replica_index=0)
    with pytest.raises(ReplicaUnavailable):
        await eng.generate("q", PROMPT, {"max_tokens": 2})
    with pytest.raises(ReplicaUnavailable):
        eng.limits()


def test_launch_command_has_documented_flags():
    cfg = RolloutConfig(
        name="sglang",
        model="/models/qwen",
        max_model_len=2048,
        sglang={"tp_size": 2, "mem_fraction_static": 0.5, "extra_args": ["--enable-memory-saver"]},
    )
    eng = SGLangEngine.from_config(cfg, replica_index=0)
    eng.port = 31000
    cmd = eng._command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for flag in (
        "--model-path /models/qwen",
        "--host 127.0.0.1",
        "--port 31000",
        "--tp-size 2",
        "--mem-fraction-static 0.5",
        "--context-length 2048",
    ):
        assert flag in joined
    assert cmd[-1] == "--enable-memory-saver"
    assert eng._env().get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    eng.assign("10.0.0.2", ["3", "4"])
    cmd = eng._command()
    assert cmd[cmd.index("--host") + 1] == "10.0.0.2" and eng._env()["CUDA_VISIBLE_DEVICES"] == "3,4"


@pytest.mark.asyncio
async def test_launch_failure_is_engine_dead_with_log_tail():
    # sglang is not installed on this machine: the launched server dies at import time.
    try:
        import sglang  # noqa: F401

        pytest.skip("sglang is installed here; this test checks the failure path")
    except ImportError:
        pass
    cfg = RolloutConfig(name="sglang", model="/nonexistent/model", sglang={"startup_timeout_s": 30.0})
    eng = SGLangEngine.from_config(cfg, replica_index=0)
    t0 = time.monotonic()
    with pytest.raises(EngineDead) as err:
        await eng.start()
    assert time.monotonic() - t0 < 20
    assert "exited with code" in str(err.value) and "sglang" in str(err.value)
    assert eng.pid is None  # reaped by shutdown()


class LaunchedFakeSGLang(SGLangEngine):
    """SGLang's launch path, with the fake server as the launched process."""

    def _command(self) -> list[str]:
        fake = Path(__file__).with_name("fake_sglang.py")
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
async def test_a_launched_server_is_supervised_watched_and_restartable():
    """What every HTTP engine gets from the shared core: the exit watcher reports a killed server
    dead at once, shutdown kills the group and removes the work dir, start brings it back."""
    eng = LaunchedFakeSGLang(model="fake/model", vocab_size=VOCAB, startup_timeout_s=30.0)
    await eng.start()
    pid, workdir = eng.pid, eng.workdir
    assert pid and eng.address() == f"http://127.0.0.1:{eng.port}" and eng.stats()["sglang_pid"] == pid
    assert (await eng.generate("a", PROMPT, {"max_tokens": 3})).token_ids == expected_tokens(
        PROMPT, 3, vocab_size=VOCAB
    )
    os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: not eng.is_alive(), timeout=5)
    health = await eng.health()
    assert not health.healthy and "exited with code -9" in health.detail
    with pytest.raises(EngineDead):
        await eng.generate("b", PROMPT, {"max_tokens": 3})
    await eng.start()  # a restart clears what is left of the dead server
    assert eng.pid != pid and not workdir.exists()
    assert (await eng.generate("c", PROMPT, {"max_tokens": 2})).stop_reason == "length"
    workdir = eng.workdir
    await eng.shutdown()
    assert eng.pid is None and not workdir.exists()
