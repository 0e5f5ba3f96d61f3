"""Two-phase weight updates of the SGLang engine (stage a state dict on tmpfs, commit it through
``/update_weights_from_disk`` in ``abort`` or ``keep`` mode), against the fake SGLang server, and
the fake's own SGLang behaviour that those updates rely on."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch

from rollfleet.engines.sglang import SGLangEngine, wire
from rollfleet.engines.sglang.staging import WEIGHTS_FILE
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported

try:
    from tests.engines.fake_server import wait_until
    from tests.engines.fake_sglang import FakeSGLangServer, expected_tokens, safetensors_names, salt_for
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_server import wait_until
    from fake_sglang import FakeSGLangServer, expected_tokens, safetensors_names, salt_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VOCAB = 1000
PROMPT = [11, 12, 13]


def state_dict(seed: int = 0, n: int = 3, size: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(size, size, generator=g) for i in range(n)}


def continued(prompt: list[int], k: int, salt_a: int, n: int, salt_b: int) -> list[int]:
    """``n`` tokens: the first ``k`` under weights ``salt_a``, the rest under ``salt_b`` from there."""
    head = expected_tokens(prompt, k, salt=salt_a, vocab_size=VOCAB)
    return head + expected_tokens([head[-1] if head else prompt[-1]], n - k, salt=salt_b, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def shared_fake():
    server = FakeSGLangServer(vocab_size=VOCAB, context_length=256).start()
    yield server
    server.stop()


@pytest.fixture
def fake(shared_fake):
    yield shared_fake.reset()
    shared_fake.release_all()


def new_engine(fake: FakeSGLangServer, stage_dir: Path, key: str = "fleet", replica: int = 0) -> SGLangEngine:
    return SGLangEngine(
        model="fake/model", base_url=fake.url, replica_id=f"sglang-{replica}", vocab_size=VOCAB,
        startup_timeout_s=5.0, request_timeout_s=10.0, stage_dir=str(stage_dir), stage_key=key,
    )  # fmt: skip


@pytest_asyncio.fixture
async def engine(fake, tmp_path):
    eng = new_engine(fake, tmp_path / "shm")
    await eng.start()
    yield eng
    await eng.shutdown()


async def commit_abort(engine: SGLangEngine, version: int) -> None:
    """What the replica does for an abort commit: pause, commit, resume."""
    await engine.pause()
    try:
        await engine.commit_weights(version, "abort")
    finally:
        await engine.resume()


# ---------------------------------------------------------------------------------------- wire


def test_wire_token_versions_server_version_and_overlap():
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
    assert wire.token_versions(spans, 5, {"1": 1, "2": 2}) == [1, 1, 2, 2, 2]
    assert wire.token_versions(spans, 5, {"2": 2}) is None  # a label the engine did not commit
    assert wire.token_versions([{"version": "default", "start": 0, "end": 3}], 3, {"1": 1}) is None
    assert wire.token_versions(spans, 6, {"1": 1, "2": 2}) is None  # a token no span covers
    assert wire.token_versions(spans + spans[1:], 5, {"1": 1, "2": 2}) is None  # covered twice
    assert wire.token_versions(None, 5, {"1": 1}) is None  # servers before 0.5.19
    assert wire.token_versions([{"version": "3", "start": 0, "end": 0}], 0, {"3": 3}) == []
    assert wire.server_version({"version": "0.5.23"}) == (0, 5, 23)
    assert wire.server_version({"version": "0.5.5.post3"}) == (0, 5, 5)
    assert wire.server_version({"version": "0.5.24.dev3+g1a2b"}) == (0, 5, 24)
    assert wire.server_version({"version": "0.0.0.dev0"}) == (0, 0, 0) < wire.KEEP_SINCE
    assert wire.server_version({}) is None and wire.server_version(None) is None
    assert wire.overlap_scheduled({"disable_overlap_schedule": False})
    assert not wire.overlap_scheduled({"disable_overlap_schedule": True})
    assert not wire.overlap_scheduled({"scheduling": {"disable_overlap_schedule": True}})
    assert wire.overlap_scheduled({}) and wire.overlap_scheduled(None)
    assert wire.update_body("/d", "3", keep=True) == {
        "model_path": "/d", "weight_version": "3", "abort_all_requests": False, "flush_cache": False,
    }  # fmt: skip
    assert wire.update_body("/d", "3", keep=False)["abort_all_requests"] is True
    assert wire.load_touched_weights("Failed to update weights: boom.\nRolling back to original weights.")
    assert not wire.load_touched_weights("Failed to get weights iterator: Cannot find any model weights with `x`.")


# ---------------------------------------------------------------------------------------- stage


@pytest.mark.asyncio
async def test_a_state_dict_is_staged_once_per_node_key(fake, tmp_path):
    root = tmp_path / "shm"
    a, b = new_engine(fake, root, replica=0), new_engine(fake, root, replica=1)
    other = new_engine(fake, root, key="other-fleet", replica=2)
    for eng in (a, b, other):
        await eng.start()
    try:
        weights = state_dict()
        await asyncio.gather(a.stage_weights(weights, 1), b.stage_weights(weights, 1))
        folder = root / "fleet" / "v1"
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [WEIGHTS_FILE, f"{WEIGHTS_FILE}.{a.stage.owner}", f"{WEIGHTS_FILE}.{b.stage.owner}"]
        )  # one file, and each engine's hold on it: nothing SGLang's *.safetensors glob would load twice
        assert sorted([a.last_stage["written"], b.last_stage["written"]])[0] == 0  # the second reused it
        assert max(a.last_stage["written"], b.last_stage["written"]) == (folder / WEIGHTS_FILE).stat().st_size
        assert safetensors_names(str(folder / WEIGHTS_FILE)) == sorted(weights)
        await other.stage_weights(weights, 1)  # another fleet's key: a file of its own
        assert (root / "other-fleet" / "v1" / WEIGHTS_FILE).exists()

        await commit_abort(a, 1)
        await commit_abort(b, 1)
        assert [body["model_path"] for body in fake.bodies("/update_weights_from_disk")] == [str(folder)] * 2
        assert fake.loads == [(str(folder), sorted(weights))] * 2
    finally:
        for eng in (a, b, other):
            await eng.shutdown()
    assert not (root / "fleet").exists() and not (root / "other-fleet").exists()  # shutdown released all


@pytest.mark.asyncio
async def test_staging_while_requests_run_does_not_disturb_them(fake, engine):
    fake.token_delay_s = 0.01
    tasks = [asyncio.create_task(engine.generate(f"g{i}", PROMPT, {"max_tokens": 60})) for i in range(3)]
    await wait_until(lambda: len(fake.running) == 3)
    await engine.stage_weights(state_dict(n=8, size=128), 1)
    assert not any(t.done() for t in tasks)  # staged while they ran
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(o.stop_reason == "length" for o in outs)
    assert all(o.token_ids == expected_tokens(PROMPT, 60, vocab_size=VOCAB) for o in outs)  # the boot weights
    assert not {"/pause_generation", "/abort_request", "/update_weights_from_disk"} & set(fake.paths())
    assert fake.weight_version == "default" and engine.last_stage["written"] > 0


# ---------------------------------------------------------------------------------------- commit


@pytest.mark.asyncio
async def test_commit_abort_aborts_in_flight_loads_labels_and_flushes(fake, engine):
    await engine.stage_weights(state_dict(), 1)
    folder = str(engine.stage.folder(1))
    fake.token_delay_s = 0.01
    task = asyncio.create_task(engine.generate("a", PROMPT, {"max_tokens": 400}))
    await wait_until(lambda: fake.request("a") is not None and len(fake.request("a")["tokens"]) >= 2)
    await engine.pause()
    partial = await asyncio.wait_for(task, 5)
    assert partial.stop_reason == "aborted" and len(partial.token_ids) >= 2
    await engine.commit_weights(1, "abort")
    assert fake.bodies("/update_weights_from_disk") == [
        {"model_path": folder, "weight_version": "1", "abort_all_requests": True, "flush_cache": False}
    ]
    assert fake.log == ["pause abort", "load 1", "flush"]  # the engine flushed after the load
    await engine.resume()

    fake.token_delay_s = 0.0
    out = await engine.generate("b", PROMPT, {"max_tokens": 6})
    assert out.token_ids == expected_tokens(PROMPT, 6, salt=salt_for(folder), vocab_size=VOCAB)
    assert out.extra_fields["engine_weight_version"] == "1" and out.token_versions == [1] * 6
    assert fake.bodies("/generate")[-1]["extra_key"] == "1"  # a radix-cache namespace per weight version
    assert "extra_key" not in fake.bodies("/generate")[0]  # the boot weights: none
    assert engine.weight_label == "1" and engine.last_commit["mode"] == "abort"
    with pytest.raises(KeyError):
        await engine.commit_weights(1, "abort")  # committed: no longer staged


@pytest.mark.asyncio
async def test_commit_keep_continues_in_flight_requests_on_new_weights(fake, tmp_path):
    fake.disable_overlap_schedule = True  # spans are exact: per-token versions come through
    engine = new_engine(fake, tmp_path / "shm")
    await engine.start()
    try:
        await keep_commit_scenario(fake, engine)
    finally:
        await engine.shutdown()


async def keep_commit_scenario(fake: FakeSGLangServer, engine: SGLangEngine) -> None:
    assert engine.update_modes == frozenset({"abort", "keep"})
    await engine.stage_weights(state_dict(1), 1)
    await commit_abort(engine, 1)
    s1 = salt_for(str(engine.stage.folder(1)))
    await engine.stage_weights(state_dict(2), 2)
    s2 = salt_for(str(engine.stage.folder(2)))
    fake.log.clear()

    fake.token_delay_s = 0.01
    kept = asyncio.create_task(engine.generate("k", PROMPT, {"max_tokens": 40}))
    await wait_until(lambda: fake.request("k") is not None and len(fake.request("k")["tokens"]) >= 3)
    commit = asyncio.create_task(engine.commit_weights(2, "keep"))
    await wait_until(lambda: fake.engine_paused or commit.done())
    held = asyncio.create_task(engine.generate("new", PROMPT, {"max_tokens": 3}))  # during the commit
    await commit
    out = await asyncio.wait_for(kept, 5)

    assert fake.log == ["pause in_place", "load 2", "continue"]
    assert fake.bodies("/pause_generation")[-1] == {"mode": "in_place"}
    assert fake.bodies("/update_weights_from_disk")[-1] == {
        "model_path": str(engine.stage.folder(2)), "weight_version": "2", "abort_all_requests": False,
        "flush_cache": False,
    }  # fmt: skip
    assert out.stop_reason == "length" and len(out.token_ids) == 40  # kept: not aborted, not resubmitted
    assert not fake.bodies("/abort_request") and out.num_preempted == 0  # no retraction: KV kept
    assert [b["rid"].split("@")[0] for b in fake.bodies("/generate")].count("k") == 1
    assert out.token_versions is not None
    k = out.token_versions.count(1)
    assert 3 <= k < 40 and out.token_versions == [1] * k + [2] * (40 - k)
    assert out.token_ids == continued(PROMPT, k, s1, 40, s2)  # the rest came from the new weights
    assert out.extra_fields["engine_weight_versions"][-1]["version"] == "2"
    new = await asyncio.wait_for(held, 5)
    assert new.token_versions == [2] * 3 and fake.bodies("/generate")[-1]["extra_key"] == "2"
    assert engine.weight_label == "2" and engine.last_commit["mode"] == "keep"
    assert engine.last_commit["pause_s"] >= engine.last_commit["load_s"]
    assert not engine.stage.folder(1).exists() and engine.stage.folder(2).exists()  # v1 released


@pytest.mark.asyncio
async def test_keep_on_the_overlap_scheduler_leaves_versions_of_straddling_requests_unknown(fake, engine):
    assert engine.update_modes == frozenset({"abort", "keep"})  # overlap on (SGLang's default)
    await engine.stage_weights(state_dict(1), 1)
    await commit_abort(engine, 1)
    await engine.stage_weights(state_dict(2), 2)
    fake.token_delay_s = 0.01
    kept = asyncio.create_task(engine.generate("k", PROMPT, {"max_tokens": 30}))
    await wait_until(lambda: fake.request("k") is not None and len(fake.request("k")["tokens"]) >= 3)
    await engine.commit_weights(2, "keep")
    out = await asyncio.wait_for(kept, 5)
    assert out.stop_reason == "length" and len(out.token_ids) == 30
    spans = out.extra_fields["engine_weight_versions"]
    assert [s["version"] for s in spans] == ["1", "2"]  # SGLang's spans are there...
    assert out.token_versions is None  # ...but their boundary may be a token late: not exact
    fake.token_delay_s = 0.0
    after = await engine.generate("after", PROMPT, {"max_tokens": 4})
    assert after.token_versions == [2] * 4  # a request after the commit is exact again


@pytest.mark.asyncio
async def test_keep_is_refused_by_servers_that_cannot_keep(fake, tmp_path):
    for version in ("0.5.6", "0.5.5.post3", "0.4.10"):
        fake.reset(version=version)
        eng = new_engine(fake, tmp_path / "shm")
        assert eng.update_modes == frozenset({"abort"})  # not started: unknown
        await eng.start()
        try:
            assert eng.update_modes == frozenset({"abort"})
            await eng.stage_weights(state_dict(), 1)
            with pytest.raises(NotSupported) as err:
                await eng.commit_weights(1, "keep")
            assert "0.5.7" in err.value.reason and not fake.bodies("/pause_generation")
            await commit_abort(eng, 1)  # abort works everywhere
            assert fake.scheduler_version == "1"
        finally:
            await eng.shutdown()


@pytest.mark.asyncio
async def test_a_failing_commit_raises_a_typed_error_and_keep_continues(fake, engine):
    await engine.stage_weights(state_dict(), 1)
    (engine.stage.folder(1) / WEIGHTS_FILE).unlink()  # gone before the commit: SGLang finds no weights
    fake.token_delay_s = 0.01
    running = asyncio.create_task(engine.generate("r", PROMPT, {"max_tokens": 40}))
    await wait_until(lambda: fake.request("r") is not None and len(fake.request("r")["tokens"]) >= 2)
    with pytest.raises(InvalidRequest) as err:
        await engine.commit_weights(1, "keep")
    assert err.value.field == "weights" and "Cannot find any model weights" in err.value.detail
    assert fake.log == ["pause in_place", "load 1", "continue"]  # continued all the same
    out = await asyncio.wait_for(running, 5)
    assert out.stop_reason == "length" and out.token_ids == expected_tokens(PROMPT, 40, vocab_size=VOCAB)
    assert engine.weight_label is None and fake.weight_version == "default"
    assert 1 in engine._staged  # still staged: the caller may stage again or give up

    with pytest.raises(InvalidRequest):  # a path that holds no weights is refused when staged
        await engine.stage_weights(str(engine.stage.path), 2)


@pytest.mark.asyncio
async def test_a_load_that_fails_midway_marks_the_engine_dead(fake, engine):
    await engine.stage_weights(state_dict(), 1)
    (engine.stage.folder(1) / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    await engine.pause()
    with pytest.raises(EngineDead) as err:
        await engine.commit_weights(1, "abort")
    assert "unknown state" in str(err.value) and not engine.is_alive()


# ---------------------------------------------------------------------------------------- cleanup


@pytest.mark.asyncio
async def test_staged_files_are_released_after_a_later_commit_and_at_shutdown(fake, engine, tmp_path):
    key = engine.stage.path
    await engine.stage_weights(state_dict(1), 1)
    await commit_abort(engine, 1)
    assert engine.stage.folder(1).exists()  # the committed version stays until a later commit
    await engine.stage_weights(state_dict(2), 2)
    await engine.stage_weights(state_dict(3), 3)  # restaged before a commit: v2 is dropped
    assert not engine.stage.folder(2).exists()
    await commit_abort(engine, 3)
    assert sorted(p.name for p in key.iterdir()) == ["v3"]

    user_dir = tmp_path / "ckpt"
    user_dir.mkdir()
    torch_file = user_dir / "model-00001.safetensors"
    from safetensors.torch import save_file

    save_file(state_dict(4), str(torch_file))
    await engine.stage_weights(str(torch_file), 4)  # a single file: loaded through a folder of its own
    linked = engine._staged[4].folder
    assert (linked / WEIGHTS_FILE).resolve() == torch_file.resolve()
    await commit_abort(engine, 4)
    assert fake.loads[-1] == (str(linked), sorted(state_dict(4)))
    await engine.stage_weights(str(user_dir), 5)  # a folder: used where it is
    await commit_abort(engine, 5)
    assert fake.loads[-1][0] == str(user_dir)
    assert not engine.stage.folder(3).exists() and not linked.exists()
    await engine.shutdown()
    assert not key.exists() and torch_file.exists()  # the user's files are never removed


@pytest.mark.asyncio
async def test_update_weights_takes_a_state_dict(fake, engine):
    await engine.update_weights(state_dict(7))
    ((path, names),) = fake.loads
    assert names == sorted(state_dict(7)) and not os.path.exists(path)  # loaded, then its scratch removed
    assert fake.weight_version == engine.weight_label == "reload-1" and fake.flushes == 1
    out = await engine.generate("x", PROMPT, {"max_tokens": 3})
    assert out.token_ids == expected_tokens(PROMPT, 3, salt=salt_for(path), vocab_size=VOCAB)
    assert out.token_versions is None  # weights of no version


# ---------------------------------------------------------------------------------------- the fake's SGLang


@pytest.mark.asyncio
async def test_fake_refuses_what_sglang_refuses(fake, tmp_path):
    """The fake's SGLang: a flush while requests run, a bad pause mode, a body without model_path,
    a pause mode before 0.5.6 (ignored: it aborts)."""
    from safetensors.torch import save_file

    folder = tmp_path / "w"
    folder.mkdir()
    save_file(state_dict(), str(folder / "model.safetensors"))
    fake.token_delay_s = 0.01
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as client:
        gen = asyncio.create_task(client.post("/generate", json={"input_ids": PROMPT, "rid": "z",
                                                                 "sampling_params": {"max_new_tokens": 50}}))  # fmt: skip
        await wait_until(lambda: fake.request("z") is not None and len(fake.request("z")["tokens"]) >= 2)
        assert (await client.post("/pause_generation", json={"mode": "sideways"})).status_code == 400
        assert (await client.post("/update_weights_from_disk", json={"flush_cache": False})).status_code == 400
        assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        assert (await client.post("/flush_cache")).status_code == 400  # requests frozen in place
        r = await client.post("/update_weights_from_disk", json={"model_path": str(folder), "weight_version": "9"})
        assert r.status_code == 400 and "cache was not flushed" in r.json()["message"]
        assert fake.scheduler_version == "9" and fake.weight_version == "default"  # loaded, label half-moved
        await client.post("/continue_generation", json={})
        answer = (await gen).json()
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert [s["version"] for s in answer["meta_info"]["weight_versions"]] == ["default", "9"]

        fake.reset(version="0.5.5", token_delay_s=0.01)
        gen = asyncio.create_task(client.post("/generate", json={"input_ids": PROMPT, "rid": "y",
                                                                 "sampling_params": {"max_new_tokens": 50}}))  # fmt: skip
        await wait_until(lambda: fake.request("y") is not None)
        await client.post("/pause_generation", json={"mode": "in_place"})  # no mode then: abort
        answer = (await gen).json()
        assert answer["meta_info"]["finish_reason"]["type"] == "abort" and "weight_versions" not in answer["meta_info"]
        await client.post("/continue_generation", json={})
