"""``rollfleet calibrate`` on one real vLLM server (CPU build, the built-in tiny model): the fitted
cost model explains what vLLM measured, and the profile it writes is one ``rollfleet plan`` takes."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from rollfleet.cli.main import main
from rollfleet.plan.profiles import load_profile

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def test_calibrate_measures_vllm_and_plan_runs_on_the_profile(tmp_path, capsys):
    config = tmp_path / "vllm.yaml"
    config.write_text(
        "rollout:\n  name: vllm\n  model: tiny\n  max_model_len: 1024\n  num_replicas: 2\n"
        "  vllm: {max_num_seqs: 64, startup_timeout_s: 300}\n"
    )
    profile_path = tmp_path / "vllm-cpu-tiny.yaml"
    args = ["calibrate", "--config", str(config), "--grid", "quick", "--repeats", "3", "--out", str(profile_path)]
    code = main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    profile = load_profile(str(profile_path))
    costs = {"step_base_ms", "step_per_seq_ms", "step_per_context_token_ms", "prefill_per_token_ms"}
    assert set(profile) == costs | {"tensor_parallel_size"}
    assert profile["tensor_parallel_size"] == 1  # the replica measured: a plan at another tp refuses it
    assert all(profile[k] >= 0 for k in costs) and profile["step_base_ms"] > 0, profile
    # the model explains the measurements: the header states the fit's median error
    median = float(re.search(r"median \|error\| (\d+)%", profile_path.read_text()).group(1))
    # 8-18% in runs here; 32% once on a loaded CI host at 2 repeats (one probe 63% off): noise only
    # adds time and the fastest of 3 counts, but two CPU engines on 2 shared cores stay noisy.
    assert median <= 40, profile_path.read_text()
    assert "measured s" in out and "predicted s" in out

    plan_config = tmp_path / "plan.yaml"
    plan_config.write_text("rollout: {n: 2, prompt_length: 32, response_length: 64}\ntrainer: {train_batch_size: 2}\n")
    args = ["plan", "--config", str(plan_config), "--gpus", "2", "--modes", "sync", "--seeds", "0", "--steps", "2"]
    assert main([*args, "--profile", str(profile_path), "--out", str(tmp_path / "plan")]) == 0
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["summary"][0]["step_s"] > 0
