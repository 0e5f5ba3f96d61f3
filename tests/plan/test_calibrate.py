"""The calibration's fit, on synthetic data and on the sim engine itself (whose costs are known)."""

from __future__ import annotations

import random

import pytest

from rollfleet.cli.main import main
from rollfleet.config import RolloutConfig
from rollfleet.engines import build_engine
from rollfleet.plan.calibrate import Measurement, default_grid, fit, measure
from rollfleet.plan.profiles import load_profile, names, write_profile
from rollfleet.utils import virtual_time

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

TRUE = {
    "step_base_ms": 7.0,
    "step_per_seq_ms": 0.06,
    "step_per_context_token_ms": 0.00015,
    "prefill_per_token_ms": 0.04,
    "overhead_ms": 2.0,
}


def synthetic(constants: dict, noise: float = 0.0, seed: int = 0) -> list[Measurement]:
    rng = random.Random(seed)
    out = []
    for probe in default_grid():
        ms = sum(constants[k] * x for k, x in zip(constants, probe.features()))
        out.append(Measurement(probe, ms / 1000 * (1 + rng.uniform(0, noise))))
    return out


def test_the_fit_recovers_the_constants_that_made_the_data():
    profile = fit(synthetic(TRUE))
    for key, value in TRUE.items():
        assert profile.constants[key] == pytest.approx(value, rel=1e-6), key
    assert max(abs(e) for e in profile.errors()) < 1e-9


def test_with_noise_the_fit_stays_close_and_never_goes_negative():
    profile = fit(synthetic(TRUE, noise=0.05, seed=3))
    assert all(v >= 0 for v in profile.constants.values())
    assert profile.constants["step_base_ms"] == pytest.approx(7.0, rel=0.1)
    assert max(abs(e) for e in profile.errors()) < 0.06
    # a term the data does not need comes out zero rather than negative
    no_context = dict(TRUE, step_per_context_token_ms=0.0, overhead_ms=0.0)
    profile = fit(synthetic(no_context, noise=0.02, seed=1))
    assert profile.constants["step_per_context_token_ms"] >= 0 and profile.constants["overhead_ms"] >= 0


def test_too_few_measurements_are_refused():
    with pytest.raises(ValueError, match="need at least 5 measurements"):
        fit(synthetic(TRUE)[:3])


def test_measurements_that_cannot_fit_the_terms_are_refused():
    """Five alike probes fitted arbitrary constants with 0% error; a probe of 0 s fitted a free
    engine; NaN was a LinAlgError."""
    alike = [Measurement(synthetic(TRUE)[0].probe, 0.5) for _ in range(6)]
    with pytest.raises(ValueError, match="the probes cannot tell the 5 cost terms apart"):
        fit(alike)
    for seconds in (0.0, -1.0, float("inf"), float("nan")):
        data = synthetic(TRUE)
        data[3] = Measurement(data[3].probe, seconds)
        with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
            fit(data)


def test_what_calibration_cannot_measure_or_write_is_refused_before_an_engine_starts(tmp_path, monkeypatch, capsys):
    """A sim engine paced faster than real time was measured that much cheaper (time_scale 50:
    costs 50x too low, written as a profile); an --out that could not be written failed after
    all the measuring, with a traceback."""
    import rollfleet.cli.calibrate as calibrate_cli

    monkeypatch.setattr(calibrate_cli, "build_engine", lambda *a, **k: pytest.fail("an engine started"))
    fast = tmp_path / "fast.yaml"
    fast.write_text("rollout: {name: sim, sim: {time_scale: 50}}\n")
    assert main(["calibrate", "--config", str(fast), "--out", str(tmp_path / "p.yaml")]) == 2
    assert "rollout.sim.time_scale must be 1 to calibrate the sim engine" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    for out, says in (
        (tmp_path, "is a folder, not a file"),
        (tmp_path / "afile" / "p.yaml", "is a file, not a folder"),
    ):
        assert main(["calibrate", "--engine", "sim", "--out", str(out)]) == 2
        assert "rollfleet calibrate: --out: " in (err := capsys.readouterr().err) and says in err, err
    # a probe's batch run in waves or preempted is timed as something else and fitted all the same
    for text, says in (
        ("rollout: {name: sim, sim: {max_num_seqs: 8}}", "rollout.sim.max_num_seqs (8) must be >= 32"),
        ("rollout: {name: sim, sim: {kv_capacity_tokens: 4096}}", "rollout.sim.kv_capacity_tokens (4096) must be >="),
    ):
        narrow = tmp_path / "narrow.yaml"
        narrow.write_text(text + "\n")
        assert main(["calibrate", "--config", str(narrow), "--out", str(tmp_path / "p.yaml")]) == 2
        assert says in capsys.readouterr().err


def test_a_profile_file_that_is_not_engine_costs_is_refused_naming_it(tmp_path):
    """A broken or non-mapping file was a yaml or AttributeError traceback; keys beside
    rollout.sim (replicas, steps) were ignored, silently."""
    for name, text, says in (
        ("broken.yaml", "rollout:\n  sim: [1, 2\n", "not a readable YAML file"),
        ("list.yaml", "- 1\n- 2\n", "has no rollout.sim section"),
        ("scalar.yaml", "rollout: 5\n", "has no rollout.sim section"),
        ("extra.yaml", "rollout: {num_replicas: 99, sim: {step_base_ms: 1}}\ntrainer: {total_steps: 9}\n",
         "only rollout.sim may be set, not trainer, rollout.num_replicas"),
    ):  # fmt: skip
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=f"profile {path}.*{says}"):
            load_profile(str(path))


def test_no_repeats_are_refused_before_an_engine_starts(tmp_path, monkeypatch, capsys):
    """``--repeats 0`` measured nothing, fitted every probe's inf seconds to a free engine and wrote
    that profile; a plan on it would have priced every step at 0."""
    import rollfleet.cli.calibrate as calibrate_cli

    monkeypatch.setattr(calibrate_cli, "build_engine", lambda *a, **k: pytest.fail("an engine started"))
    out = tmp_path / "p.yaml"
    assert main(["calibrate", "--engine", "sim", "--repeats", "0", "--out", str(out)]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="repeats must be >= 1, got -1"):
        virtual_time.run(measure(build_engine(RolloutConfig(name="sim"), replica_index=0), default_grid(), repeats=-1))


def test_calibrating_the_sim_engine_finds_its_own_costs():
    """The probe model matches how the sim engine schedules: measured through the engine
    interface in virtual time, the fit returns the constants the engine was given."""
    sim = {
        "step_base_ms": 5.0,
        "step_per_seq_ms": 0.1,
        "prefill_per_token_ms": 0.03,
        "step_per_context_token_ms": 0.0002,
    }
    rollout = RolloutConfig.model_validate({"name": "sim", "max_model_len": 2048, "sim": {"time_scale": 1.0, **sim}})

    async def run() -> list[Measurement]:
        engine = build_engine(rollout, replica_index=0)
        await engine.start()
        try:
            return await measure(engine, default_grid(), repeats=1)
        finally:
            await engine.shutdown()

    profile = fit(virtual_time.run(run()))
    for key, value in sim.items():
        assert profile.constants[key] == pytest.approx(value, rel=0.05, abs=1e-6), (key, profile.constants)
    assert max(abs(e) for e in profile.errors()) < 0.02


def test_profiles_ship_and_round_trip(tmp_path):
    assert "h100-7b" in names()
    assert load_profile("h100-7b")["step_base_ms"] == 7.0
    path = write_profile(tmp_path / "p.yaml", {"step_base_ms": 1.5}, "measured\nhere")
    assert path.read_text().startswith("# measured\n# here\n")
    assert load_profile(str(path)) == {"step_base_ms": 1.5}
    from rollfleet.plan.calibrate import TERMS, Profile

    # a GPU's per-context-token cost survives the write (rounded to 6 decimals of a ms, it was 0)
    tiny = Profile(dict.fromkeys(TERMS, 1.0) | {"step_per_context_token_ms": 4e-7})
    assert tiny.sim_section()["step_per_context_token_ms"] == 4e-7
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        load_profile("nope")


def test_plan_takes_a_profile_and_refuses_an_unknown_one(tmp_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text("rollout: {n: 2, response_length: 128}\ntrainer: {train_batch_size: 2}\n")
    args = ["plan", "--config", str(config), "--gpus", "2", "--modes", "sync", "--seeds", "0", "--steps", "2"]
    args += ["--out", str(tmp_path)]
    assert main([*args, "--profile", "nope"]) == 2
    assert "unknown profile 'nope'" in capsys.readouterr().err
    slow = write_profile(tmp_path / "slow.yaml", {"step_base_ms": 70.0}, "10x the default step")
    assert main([*args, "--profile", "h100-7b"]) == 0
    fast = _step_s(tmp_path)
    assert main([*args, "--profile", str(slow)]) == 0
    assert _step_s(tmp_path) > 3 * fast  # the profile's costs are what the plan ran on
    # a calibrated profile (step costs, no KV size) beside a model: the KV cache is the roofline's
    import argparse

    from rollfleet.cli.plan import add_arguments, overrides_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    model = parser.parse_args([*args[1:], "--profile", str(slow), "--model-params-b", "7"])
    assert overrides_from_args(model)["rollout.sim.kv_capacity_tokens"] > 100_000


def _step_s(out) -> float:
    import json

    return json.loads((out / "plan.json").read_text())["summary"][0]["step_s"]
