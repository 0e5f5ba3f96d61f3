"""``rollfleet plan``: the real trainer modes on a virtual cluster, end to end, and repeatable."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollfleet.cli.main import main
from rollfleet.config import RollfleetConfig, load_config
from rollfleet.models.vocab import fit_sim_to_model
from rollfleet.plan import VirtualRuntime
from rollfleet.plan.learner_cost import learner_seconds_per_token
from rollfleet.plan.planner import (
    MODES,
    ModeRun,
    PlanResult,
    PlanSpec,
    run_mode,
    run_plan,
    run_plans,
    start_order,
)
from rollfleet.plan.report import write_plan
from rollfleet.trainer import get_trainer_cls
from rollfleet.trainer.config import SimLearnerConfig, TrainConfig
from rollfleet.trainer.sim_learner import SimulatedLearner
from rollfleet.trainer.tracking import read_jsonl
from rollfleet.utils import virtual_time

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

WORKLOAD = {
    "rollout": {
        "n": 4,
        "prompt_length": 64,
        "response_length": 512,
        "max_model_len": 600,
        "sim": {"mean_response_tokens": 120, "response_sigma": 1.2},
    },
    "agent": {"num_workers": 2},
    "trainer": {
        "total_steps": 4,
        "train_batch_size": 4,
        "max_off_policy_steps": 1,
        "sim_learner": {"seconds_per_token": 2e-4},
    },
}


def workload_config(**extra: object) -> RollfleetConfig:
    """The test workload; ``extra``: dotted overrides on top (``**{"trainer.seed": 1}``)."""
    overrides = {f"{section}.{key}": value for section, keys in WORKLOAD.items() for key, value in _flat(keys).items()}
    return fit_sim_to_model(load_config(None, {"rollout.name": "sim", **overrides, **extra}))


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_every_mode_runs_on_its_share_of_the_cluster_and_a_plan_repeats_exactly(tmp_path):
    """Repeats exactly in this process, and again spread over two spawned ones (each with its own
    string-hash seed: a decision made on ``hash()`` of a string would show as a difference)."""
    spec = PlanSpec(workload_config(), gpus=4, seeds=(0, 1), output_dir=str(tmp_path / "a"))
    seen: list[tuple[str, int]] = []
    first = run_plan(spec)
    second = run_plan(
        dataclasses.replace(spec, output_dir=str(tmp_path / "b")),
        on_run=lambda r: seen.append((r.mode, r.seed)),
        workers=2,
    )
    assert sorted(seen) == sorted((r.mode, r.seed) for r in first.runs)  # every run reported as it finished
    strip = [{k: v for k, v in vars(r).items() if k != "run_dir"} for r in first.runs]
    assert strip == [{k: v for k, v in vars(r).items() if k != "run_dir"} for r in second.runs]

    rows = {r["mode"]: r for r in first.summary()}
    assert set(rows) == {"sync", "colocate_async", "separate_async"}
    assert rows["sync"]["replicas"] == 4 and rows["colocate_async"]["replicas"] == 4
    assert rows["separate_async"]["replicas"] == 2  # half the accelerators generate, half train
    sync = rows["sync"]
    assert sync["speedup_vs_sync"] == pytest.approx(1.0) and sync["staleness_max"] == 0
    assert sync["dropped_groups"] == 0
    for mode in ("colocate_async", "separate_async"):
        r = rows[mode]
        assert r["staleness_max"] <= 1  # trainer.max_off_policy_steps
        assert 0.0 <= r["trainer_idle"] <= 1.0 and 0.0 <= r["fleet_idle"] <= 1.0 and 0.0 <= r["cluster_idle"] <= 1.0
        # a long tail stalls every sync step; the async modes generate through it
        assert r["speedup_vs_sync"] > 1.2, rows
    # sync's learner waits for every trajectory of its batch: it idles more than either async mode
    assert sync["trainer_idle"] > max(rows["colocate_async"]["trainer_idle"], rows["separate_async"]["trainer_idle"])


def test_separate_async_is_planned_at_every_split_asked_beside_the_colocated_modes(tmp_path):
    """Which split of the cluster trains fastest is what a plan of ``separate_async`` asks: each
    split is its own run (its own folder), the same run a plan of that split alone makes, with its
    speed-up over the same ``sync`` runs; the fastest is named. Over two processes too."""
    spec = PlanSpec(workload_config(), gpus=4, modes=("sync", "separate_async"), seeds=(0, 1),
                    rollout_share=0.5, more_shares=(0.25, 0.75), output_dir=str(tmp_path / "sweep"))  # fmt: skip
    result = run_plan(spec, workers=2)
    rows = {r["label"]: r for r in result.summary()}
    assert list(rows) == ["sync", "separate_async 2:2", "separate_async 1:3", "separate_async 3:1"]
    for label, share, replicas in (("separate_async 2:2", 0.5, 2), ("separate_async 1:3", 0.25, 1),
                                   ("separate_async 3:1", 0.75, 3)):  # fmt: skip
        row = rows[label]
        assert (row["rollout_share"], row["replicas"], row["rollout_gpus"] + row["learner_gpus"]) == (
            share,
            replicas,
            4,
        )
    run_dirs = {r.run_dir for r in result.runs}
    assert len(run_dirs) == len(result.runs) == 8  # (sync + 3 splits) x 2 seeds, none overwriting another
    assert any(d.endswith("separate_async-1x3-seed0") for d in run_dirs)

    alone = run_plan(dataclasses.replace(spec, more_shares=(), output_dir=str(tmp_path / "alone")))
    half = {r["mode"]: r for r in alone.summary()}["separate_async"]
    assert half["label"] == "separate_async"  # a plan of one split names no split
    for key in ("step_s", "speedup_vs_sync", "trainer_idle", "fleet_idle", "dropped_groups"):
        assert rows["separate_async 2:2"][key] == half[key], key
    sync_steps = {r.seed: r.step_s for r in result.runs if r.mode == "sync"}
    quarter = [r for r in result.runs if r.rollout_share == 0.25]
    assert rows["separate_async 1:3"]["speedup_vs_sync"] == pytest.approx(
        sum(sync_steps[r.seed] / r.step_s for r in quarter) / len(quarter)
    )
    best = result.best_split()
    assert best is not None and best["tokens_per_s"] == max(r["tokens_per_s"] for k, r in rows.items() if k != "sync")
    assert alone.best_split() is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"more_shares": (0.5,)}, r"rollout shares must not repeat, got \[0.5, 0.5\]"),
        (
            {"more_shares": (0.6,)},
            r"give the same split twice \(4 accelerators, whole tp=1 replicas\): \['2:2', '2:2'\]",
        ),
        ({"more_shares": (1.2,)}, r"rollout_share must be in \(0, 1\), got 1.2"),
        ({"more_shares": (0.1,)}, r"rollout_share x gpus = 0.4 holds no tp=1 replica"),
        ({"more_shares": (0.25,), "modes": ("sync",)}, r"rollout shares \[0.25\] beyond the first \(--rollout-share\)"),
    ],
)
def test_a_split_that_plans_nothing_new_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanSpec(workload_config(), gpus=4, **kwargs)


def test_a_plan_counts_what_the_fleet_served_beyond_the_samples_trained(tmp_path):
    """``sync`` trains every token it generates from one request per sample; ``colocate_async``
    aborts what is in flight at each sync and resumes it (more requests, no token lost);
    ``separate_async`` drops stale groups (more tokens than it trains), by its own step metrics."""
    config = workload_config()
    spec = PlanSpec(config, gpus=4, seeds=(0,), output_dir=str(tmp_path))
    runs = {r.mode: r for r in run_plan(spec).runs}
    assert runs["sync"].generated_per_trained == 1.0 and runs["sync"].requests_per_sample == 1.0

    colocated = runs["colocate_async"]
    assert colocated.requests_per_sample > 1.0  # resumed after the syncs' aborts

    separate = runs["separate_async"]
    rows = read_jsonl(Path(separate.run_dir) / "metrics.jsonl")
    dropped_samples = sum(r["staleness/dropped_samples"] for r in rows)
    dropped_tokens = sum(r["staleness/dropped_samples"] * r["staleness/dropped_response_len_mean"] for r in rows)
    trained_tokens = sum(r["perf/tokens_per_s"] * r["step_s"] for r in rows)
    trained_samples = len(rows) * config.trainer.train_batch_size * config.rollout.n
    assert dropped_samples > 0, "the workload should drop stale groups"
    # the dropped groups' tokens and samples at least (groups finished but never trained add)
    assert separate.generated_per_trained >= (trained_tokens + dropped_tokens) / trained_tokens - 1e-9
    assert separate.requests_per_sample >= (trained_samples + dropped_samples) / trained_samples


def test_several_plans_on_one_pool_each_get_their_own_runs(tmp_path):
    """``run_plans`` spreads the runs of several specs over one pool; each result holds its own
    spec's runs, the same as that spec planned alone."""
    specs = [
        PlanSpec(
            workload_config(**{"trainer.max_off_policy_strategy": s}),
            gpus=4,
            modes=("separate_async",),
            seeds=(0,),
            output_dir=str(tmp_path / s),
        )
        for s in ("drop", "wait")
    ]
    together = run_plans(specs, workers=2)
    assert [r.spec for r in together] == specs
    for spec, result in zip(specs, together):
        alone = run_plan(dataclasses.replace(spec, output_dir=str(tmp_path / "alone")))
        strip = [{k: v for k, v in vars(r).items() if k != "run_dir"} for r in result.runs]
        assert strip == [{k: v for k, v in vars(r).items() if k != "run_dir"} for r in alone.runs]
    assert together[0].runs[0].dropped_groups > 0 and together[1].runs[0].dropped_groups == 0  # wait drops none


def test_spread_over_processes_the_longest_runs_start_first():
    """A pool hands runs to workers in the order they are submitted: the longest, submitted last,
    would run alone after the others (``benchmarks/plan_speed.py``: 3 runs on 2 workers, 163 s in
    the order given against 150 s longest first). A mode the planner has no cost for starts first of
    all; seeds keep their order."""
    jobs = [(mode, seed) for mode in ("sync", "colocate_async", "separate_async", "plugin_mode") for seed in (0, 1)]
    assert [jobs[i] for i in start_order(jobs)] == [
        ("plugin_mode", 0),
        ("plugin_mode", 1),
        ("colocate_async", 0),
        ("colocate_async", 1),
        ("separate_async", 0),
        ("separate_async", 1),
        ("sync", 0),
        ("sync", 1),
    ]


def test_a_plan_gives_the_same_numbers_on_a_loaded_host(tmp_path):
    spec = PlanSpec(workload_config(), gpus=2, modes=("separate_async",), seeds=(3,), output_dir=str(tmp_path))
    quiet = virtual_time.run(run_mode(spec, "separate_async", 3))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = virtual_time.run(run_mode(spec, "separate_async", 3))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert vars(quiet) == vars(loaded)
    assert quiet.step_s > 0 and quiet.replicas == 1


def test_the_learner_pays_for_its_share_of_the_cluster(tmp_path):
    """separate_async trains on half the accelerators: the same tokens take twice as long."""
    spec = PlanSpec(workload_config(), gpus=4, output_dir=str(tmp_path))
    assert spec.share_of("sync") == (4, 1.0)
    assert spec.share_of("separate_async") == (2, 0.5)
    batch = SimpleNamespace(attention_mask=torch.ones(4, 100))  # 400 tokens
    seconds = {}
    for mode in ("sync", "separate_async"):
        train = TrainConfig.model_validate(spec.config_for(mode, 0).trainer.model_dump())
        seconds[mode], _ = SimulatedLearner(train.sim_learner).step(batch)
    assert seconds["sync"] == pytest.approx(400 * 2e-4)
    assert seconds["separate_async"] == pytest.approx(2 * seconds["sync"])
    tp2 = workload_config(**{"rollout.sim.tensor_parallel_size": 2})
    assert PlanSpec(tp2, gpus=8, tp=2, rollout_share=0.75).share_of("separate_async") == (3, 0.25)
    # a share is taken as written: 100 x 0.29 is 28.999... in floating point, 29 accelerators here
    assert PlanSpec(workload_config(), gpus=100, rollout_share=0.29).share_of("separate_async") == (29, 0.71)
    assert PlanSpec(workload_config(), gpus=100, rollout_share=0.57).gpus_of("separate_async") == (57, 43)


def test_the_learner_pays_for_prompts_for_attention_quadratically_and_per_step():
    config = SimLearnerConfig(
        enabled=True, seconds_per_token=1e-4, seconds_per_token_squared=1e-7, seconds_per_step=0.5, resource_share=0.5
    )
    mask = torch.zeros(2, 1000)
    mask[0, 100:400] = 1  # a 300-token sample (left pads, prompt and response)
    mask[1, 0:1000] = 1  # a 1,000-token one
    seconds, metrics = SimulatedLearner(config).step(SimpleNamespace(attention_mask=mask))
    assert seconds == pytest.approx((1300 * 1e-4 + (300**2 + 1000**2) * 1e-7) / 0.5 + 0.5)
    assert metrics["actor/train_s"] == seconds
    # the same tokens in one long sample cost more than in short ones
    one_long = torch.ones(1, 1300)
    assert SimulatedLearner(config).step(SimpleNamespace(attention_mask=one_long))[0] > seconds


def test_the_learner_counts_a_rollout_batch_by_its_lengths_without_padding_it():
    from rollfleet.agent_loop import AgentLoopOutput, collate

    config = SimLearnerConfig(enabled=True, seconds_per_token=1e-4, seconds_per_token_squared=1e-7)
    outputs = [AgentLoopOutput(list(range(p)), [7] * r, [1] * r) for p, r in ((5, 30), (2, 900))]
    batch = collate(outputs, ["a", "b"], prompt_length=8, response_length=1024, pad_token_id=0)
    seconds, _ = SimulatedLearner(config).step(batch)
    assert batch.padded_tensors is None  # priced from the lengths: the [2, 1032] tensors never built
    assert seconds == pytest.approx(937 * 1e-4 + (35**2 + 902**2) * 1e-7)
    assert seconds == SimulatedLearner(config).step(SimpleNamespace(attention_mask=batch.attention_mask))[0]


def test_learner_cost_from_model_size():
    # 7B, 6 FLOPs per parameter and token, 64 accelerators at 989 TFLOPS and 35% MFU
    assert learner_seconds_per_token(7, 64, 989, 0.35) == pytest.approx(6 * 7e9 / (64 * 989e12 * 0.35))
    assert learner_seconds_per_token(7, 128, 989, 0.35) == pytest.approx(
        learner_seconds_per_token(7, 64, 989, 0.35) / 2
    )
    with pytest.raises(ValueError, match="mfu must be a finite number > 0, got 0"):
        learner_seconds_per_token(7, 8, 989, 0)
    with pytest.raises(ValueError, match="params_b must be a finite number > 0, got -1"):  # named alone, with its value
        learner_seconds_per_token(-1, 8, 989, 0.35)
    with pytest.raises(ValueError, match="flops_per_param_token must be a finite number > 0, got 0"):  # a free learner
        learner_seconds_per_token(7, 8, 989, 0.35, flops_per_param_token=0)
    with pytest.raises(ValueError, match="params_b must be a finite number > 0, got nan"):  # passed `<= 0`
        learner_seconds_per_token(float("nan"), 8, 989, 0.35)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gpus": 2, "tp": 4}, r"gpus \(2\) must hold at least one replica of tp=4"),
        ({"gpus": 4, "rollout_share": 1.0}, "rollout_share must be in"),
        # rounded up to every accelerator: the learner's share of 0 failed the config after the
        # other modes' runs, losing the plan
        (
            {"gpus": 4, "rollout_share": 0.9999999999999},
            r"rollout_share 0.9999999999999 leaves the learner none of the 4 accelerators",
        ),
        ({"gpus": 4, "warmup_steps": 4}, r"trainer.total_steps \(4\) must exceed warmup_steps \(4\)"),
        ({"gpus": 4, "seeds": ()}, "^seeds must not be empty"),
        ({"gpus": 4, "modes": ()}, "^modes must not be empty"),
        ({"gpus": 4, "modes": ("sync", "asynk")}, r"unknown trainer 'asynk'; valid names: \['colocate_async'"),
        ({"gpus": 4, "tp": 0}, r"tp must be >= 1, got 0"),
        ({"gpus": 5, "tp": 5, "modes": ("separate_async",)}, r"holds no tp=5 replica"),
        ({"gpus": 5, "tp": 2}, r"gpus \(5\) must be a multiple of tp \(2\): .* 1 accelerator\(s\) idle"),
        ({"gpus": 4, "tp": 2}, r"tp \(2\) differs from rollout.sim.tensor_parallel_size \(1\)"),
        ({"gpus": 4, "warmup_steps": -1}, r"warmup_steps must be >= 0, got -1"),
        ({"gpus": 4, "seeds": (0, 0)}, r"seeds must not repeat, got \[0, 0\]"),
        ({"gpus": 4, "modes": ("sync", "sync")}, r"modes must not repeat"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanSpec(workload_config(), **kwargs)


def test_a_plan_refuses_a_kv_cache_that_holds_no_whole_sequence():
    small = workload_config(**{"rollout.sim.kv_capacity_tokens": 500})  # max_model_len is 600
    with pytest.raises(ValueError, match=r"kv_capacity_tokens \(500, 496 in whole blocks of 16\) holds less than one "):
        PlanSpec(small, gpus=4)
    # 615 tokens are 38 whole blocks, 608 tokens: a 600-token sequence fits, one of 610 does not
    PlanSpec(workload_config(**{"rollout.sim.kv_capacity_tokens": 615}), gpus=4)
    tight = workload_config(**{"rollout.sim.kv_capacity_tokens": 615, "rollout.max_model_len": 610})
    with pytest.raises(ValueError, match=r"\(615, 608 in whole blocks of 16\) holds less than one sequence of "):
        PlanSpec(tight, gpus=4)


def test_a_plan_refuses_a_context_its_prompts_fill():
    """max_model_len 100 under 128-token prompts planned every prompt refused: 0 trained tokens a
    second and a 100% idle fleet, reported as a plan."""
    with pytest.raises(ValueError, match=r"rollout.max_model_len \(100\) must be > rollout.prompt_length \(128\)"):
        workload_config(**{"rollout.prompt_length": 128, "rollout.max_model_len": 100})  # refused as the config loads
    PlanSpec(workload_config(**{"rollout.prompt_length": 128, "rollout.max_model_len": 129}), gpus=4)


def test_an_uneven_split_leaves_the_rest_to_the_learner():
    tp2 = workload_config(**{"rollout.sim.tensor_parallel_size": 2})
    spec = PlanSpec(tp2, gpus=7, tp=2, modes=("separate_async",))  # 3.5 rollout accelerators asked
    assert spec.gpus_of("separate_async") == (2, 5) and spec.share_of("separate_async") == (1, 5 / 7)


def test_a_plan_starts_afresh_even_where_an_earlier_one_left_checkpoints(tmp_path):
    """``trainer.resume: true`` in the config must not make a plan continue an earlier plan's
    run in the same folder (it reported the steps left over, or crashed on none)."""
    config = workload_config(**{"trainer.resume": True, "trainer.total_steps": 3})
    spec = PlanSpec(config, gpus=2, modes=("sync",), seeds=(0,), output_dir=str(tmp_path))
    first = run_plan(spec).runs[0]
    again = run_plan(spec).runs[0]
    longer = run_plan(PlanSpec(workload_config(**{"trainer.resume": True, "trainer.total_steps": 5}), gpus=2,
                               modes=("sync",), seeds=(0,), output_dir=str(tmp_path))).runs[0]  # fmt: skip
    fresh = run_plan(PlanSpec(workload_config(**{"trainer.total_steps": 5}), gpus=2, modes=("sync",), seeds=(0,),
                              output_dir=str(tmp_path / "fresh"))).runs[0]  # fmt: skip
    assert (again.step_s, again.trainer_idle) == (first.step_s, first.trainer_idle)
    assert (longer.step_s, longer.trainer_idle, longer.fleet_idle) == (
        fresh.step_s,
        fresh.trainer_idle,
        fresh.fleet_idle,
    )


def test_the_summary_means_dropped_groups_over_seeds_and_names_each_modes_accelerators():
    spec = PlanSpec(workload_config(), gpus=4, seeds=(0, 1))

    def run(mode: str, seed: int, dropped: int, replicas: int) -> ModeRun:
        return ModeRun(mode, seed, replicas, 1.0, 0.0, 0.0, 0.0, 0.0, 0, dropped, 1.0, "", 1.0, 1.0)

    result = PlanResult(spec, [run("separate_async", 0, 12, 2), run("separate_async", 1, 10, 2), run("sync", 0, 0, 4)])
    rows = {r["mode"]: r for r in result.summary()}
    assert rows["separate_async"]["dropped_groups"] == 11  # 12 and 10 over two seeds: not their sum
    assert (rows["separate_async"]["rollout_gpus"], rows["separate_async"]["learner_gpus"]) == (2, 2)
    assert (rows["sync"]["rollout_gpus"], rows["sync"]["learner_gpus"]) == (4, 4)


def test_seeds_that_plan_the_same_step_keep_its_mean_in_its_range_and_the_plot_draws(tmp_path):
    """Seeds agree when nothing they draw changes a step (every response one length). The mean of
    three equal step times came out past them (fsum rounding), and the plot's error bar then had
    a negative length: writing the plan failed after every run had finished."""
    step = 3.7990400000000344  # three of it average to 3.799040000000035
    spec = PlanSpec(workload_config(), gpus=4, modes=("sync",), seeds=(0, 1, 2))
    runs = [ModeRun("sync", seed, 4, step, 0.9, 0.1, 0.0, 0.0, 0, 0, 1.0, "", 1.0, 1.0) for seed in (0, 1, 2)]
    (row,) = PlanResult(spec, runs).summary()
    assert row["step_s_range"] == [step, step]
    assert row["step_s_range"][0] <= row["step_s"] <= row["step_s_range"][1]
    written = write_plan(PlanResult(spec, runs), tmp_path)
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", written


def test_a_virtual_run_refuses_a_torch_learner():
    async def main_() -> None:
        runtime = VirtualRuntime()
        from rollfleet.trainer.remote_learner import LearnerSpec

        await runtime.create_learner(LearnerSpec("torch", None, "tiny"), None)

    with pytest.raises(ValueError, match="trainer.sim_learner.enabled"):
        virtual_time.run(main_())


def test_the_command_writes_the_table_the_json_and_the_pngs(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))  # JSON is YAML
    out = tmp_path / "out"
    code = main(["plan", "--config", str(config), "--gpus", "4", "--seeds", "0", "--steps", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "speed-up vs sync" in printed and "separate_async" in printed
    assert "trained tok/s" in printed and "2 / 2" in printed and "4 / 4 (the same ones)" in printed
    assert "requests / trained sample" in printed
    doc = json.loads((out / "plan.json").read_text())
    assert [r["mode"] for r in doc["summary"]] == ["sync", "colocate_async", "separate_async"]
    assert doc["gpus"] == 4 and len(doc["runs"]) == 3
    pngs = [out / "plan.png"] + [out / "runs" / f"{m}-seed0" / "timeline.png" for m in ("sync", "separate_async")]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_the_command_plans_several_splits_and_names_the_fastest(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "out"
    args = ["plan", "--config", str(config), "--gpus", "4", "--seeds", "0", "--steps", "3", "--out", str(out)]
    assert main([*args, "--modes", "sync,separate_async", "--rollout-share", "0.25, 0.5,0.75"]) == 0
    printed = capsys.readouterr().out
    for label in ("separate_async 1:3", "separate_async 2:2", "separate_async 3:1"):
        assert label in printed
    doc = json.loads((out / "plan.json").read_text())
    assert doc["rollout_shares"] == [0.25, 0.5, 0.75]
    splits = [r for r in doc["summary"] if r["mode"] == "separate_async"]
    best = min(splits, key=lambda r: (-r["tokens_per_s"], r["step_s"]))  # most trained tokens/s
    assert f"fastest split of separate_async: {best['rollout_gpus']}:{best['learner_gpus']}" in printed
    for split in ("1x3", "2x2", "3x1"):  # a timeline per split
        png = out / "runs" / f"separate_async-{split}-seed0" / "timeline.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert main([*args, "--rollout-share", "0.5,half"]) == 2
    assert "--rollout-share: 'half' is not a number" in capsys.readouterr().err


def test_the_command_plans_every_mode_at_each_replica_size_the_roofline_prices(tmp_path, capsys):
    """``--tp 1,2`` with a model: each size priced by the roofline, planned on one pool, its own
    outputs under tp{N}, the same numbers as a plan of that size alone, and every mode at every
    size in one table, JSON and PNG, the fastest named; ``--vary`` cannot vary a second thing."""
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))
    args = ["plan", "--config", str(config), "--gpus", "4", "--seeds", "0", "--steps", "3", "--model-params-b", "1"]
    assert main([*args, "--tp", "1,2", "--out", str(tmp_path / "both")]) == 0
    printed = capsys.readouterr().out
    assert "every plan: 4 accelerators" in printed
    doc = json.loads((tmp_path / "both" / "plan_variants.json").read_text())
    assert doc["plans"] == ["tp 1", "tp 2"]
    assert sorted((r["tp"], r["mode"]) for r in doc["rows"]) == sorted((tp, m) for tp in (1, 2) for m in MODES)
    assert [r["tokens_per_s"] for r in doc["rows"]] == sorted(  # fastest first
        (r["tokens_per_s"] for r in doc["rows"]), reverse=True
    )
    assert f"fastest: {doc['fastest']['label']}, tp {doc['fastest']['tp']}" in printed
    assert (tmp_path / "both" / "plan_variants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for tp, replicas in ((1, 4), (2, 2)):
        plan = json.loads((tmp_path / "both" / f"tp{tp}" / "plan.json").read_text())
        assert plan["tp"] == tp and {r["mode"]: r["replicas"] for r in plan["summary"]}["sync"] == replicas
        assert all(f"/tp{tp}/runs/" in run["run_dir"] for run in plan["runs"])
    assert main([*args, "--tp", "2", "--out", str(tmp_path / "two")]) == 0
    alone = {r["mode"]: r["step_s"] for r in json.loads((tmp_path / "two" / "plan.json").read_text())["summary"]}
    assert {r["mode"]: r["step_s"] for r in doc["rows"] if r["tp"] == 2} == alone
    capsys.readouterr()
    for extra, says in (
        (
            ["--tp", "1,2", "--model-params-b", "7", "--profile", "h100-7b"],
            "several replica sizes need --model-params-b",
        ),
        (["--tp", "1,x"], "--tp: 'x' is not an integer"),
        (["--tp", "2,2"], "--tp: give one or more different sizes, got '2,2'"),
        (["--tp", "1,2", "--vary", "rollout.n=2,4"], "--vary with several --tp sizes: vary one thing at a time"),
    ):
        assert main([*args, *extra]) == 2, extra
        assert says in capsys.readouterr().err, extra
    no_model = ["plan", "--config", str(config), "--gpus", "4", "--seeds", "0", "--tp", "1,2"]
    assert main(no_model) == 2
    assert "several replica sizes need --model-params-b without --profile" in capsys.readouterr().err


def test_the_command_plans_each_value_of_one_config_key_side_by_side(tmp_path, capsys):
    """``--vary trainer.max_off_policy_steps=0,2``: a plan per value (read as YAML), each the same
    as a plan whose config says it, in its own folder; every mode of both in one table, JSON and
    PNG. ``sync`` never waits on staleness, so its rows agree; ``separate_async`` at bound 0
    waits for every sync and is slower than at 2."""
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))
    args = [
        "plan",
        "--config",
        str(config),
        "--gpus",
        "4",
        "--seeds",
        "0",
        "--steps",
        "3",
        "--modes",
        "sync,separate_async",
    ]
    assert main([*args, "--vary", "trainer.max_off_policy_steps=0, 2", "--out", str(tmp_path / "v")]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "v" / "plan_variants.json").read_text())
    names = ["trainer.max_off_policy_steps=0", "trainer.max_off_policy_steps=2"]
    assert doc["plans"] == names and all(name in printed for name in names)
    step = {(r["plan"], r["mode"]): r["step_s"] for r in doc["rows"]}
    assert step[(names[0], "sync")] == step[(names[1], "sync")]
    assert step[(names[0], "separate_async")] > step[(names[1], "separate_async")]
    assert doc["fastest"] == max(doc["rows"], key=lambda r: r["tokens_per_s"])
    assert (tmp_path / "v" / "plan_variants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bound0 = json.loads(json.dumps(WORKLOAD))
    bound0["trainer"]["max_off_policy_steps"] = 0
    config.write_text(json.dumps(bound0))
    assert main([*args, "--out", str(tmp_path / "alone")]) == 0
    alone = json.loads((tmp_path / "alone" / "plan.json").read_text())["summary"]
    varied = json.loads((tmp_path / "v" / names[0] / "plan.json").read_text())["summary"]
    assert [(r["mode"], r["step_s"], r["trainer_idle"]) for r in varied] == [
        (r["mode"], r["step_s"], r["trainer_idle"]) for r in alone
    ]
    capsys.readouterr()
    for vary, says in (
        ("max_off_policy_steps", "--vary: KEY=V1,V2,... with a dotted config key"),
        ("trainer.=1,2", "--vary: KEY=V1,V2,... with a dotted config key"),
        ("trainer.seed=1,1", "--vary trainer.seed: values must not repeat"),
        ("trainer.max_of_policy_steps=0,1", "trainer.max_of_policy_steps"),  # a typo: the config names it
    ):
        assert main([*args, "--vary", vary]) == 2, vary
        assert says in capsys.readouterr().err, vary


def test_response_lengths_from_a_file_replace_the_log_normal(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("40, 40\n40")
    args = ["plan", "--config", str(config), "--gpus", "2", "--modes", "sync", "--seeds", "0", "--steps", "2"]
    assert main([*args, "--response-lengths", str(lengths), "--out", str(tmp_path / "a")]) == 0
    run_dir = json.loads((tmp_path / "a" / "plan.json").read_text())["runs"][0]["run_dir"]
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert [r["response_length/mean"] for r in rows] == [40.0, 40.0]  # every response drew 40
    capsys.readouterr()
    for text, bad in (("40 forty", "'forty'"), ("[40, 1.9]", "1.9"), ("[40, true]", "True"), ('[40, "300"]', "'300'"),
                      ("40 0", "0"), ("[]", None), ("40 +-5", "'+-5'"), ("40 \u00b2", "'\u00b2'")):  # fmt: skip
        lengths.write_text(text)
        assert main([*args, "--response-lengths", str(lengths), "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err
        assert (f"length [1] is {bad}, not an integer >= 1" if bad else "at least one length") in err, (text, err)


def test_the_command_refuses_flags_that_would_plan_something_else(capsys):
    """A percentage for --mfu (a 100x faster learner), a profile of one accelerator's replica at
    --tp 4 (a replica of four priced as one), a model that no replica holds, half a model shape;
    a seed that is no number and a lengths file that is not there (both were tracebacks)."""
    base = ["plan", "--gpus", "4", "--seeds", "0", "--modes", "sync"]
    cases = [
        (["--model-params-b", "7", "--mfu", "35"], "--mfu must be in (0, 1] (a fraction, not a percentage), got 35"),
        (["--profile", "h100-7b", "--tp", "4"], "tp (4) differs from rollout.sim.tensor_parallel_size (1)"),
        (["--profile", "h100-7b", "--model-params-b", "70", "--gpus", "1"], "leave no room for a KV cache"),
        (["--model-params-b", "7", "--model-layers", "28"], "--model-layers and --model-hidden go together"),
        # the flag, not the pricing functions' argument (params_b, layers, tflops_per_gpu)
        (["--model-params-b", "0"], "--model-params-b must be a finite number > 0, got 0"),
        (["--model-params-b", "7", "--model-layers", "0", "--model-hidden", "8"], "--model-layers must be"),
        (["--model-params-b", "7", "--tflops-per-gpu", "0"], "--tflops-per-gpu must be a finite number > 0"),
        (["--model-params-b", "200", "--gpus", "1"], "--model-params-b: 200B parameters"),
        (["--rollout-share", "0.25,0.5"], "rollout shares [0.5] beyond the first (--rollout-share)"),
        (["--seeds", "0,a"], "--seeds: 'a' is not an integer"),
        (
            ["--response-lengths", "/nonexistent/lengths.txt"],
            "--response-lengths /nonexistent/lengths.txt: cannot be read",
        ),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_the_command_refuses_what_it_would_ignore_and_blames_the_right_source(tmp_path, capsys):
    """Model flags without a model priced nothing (the config's costs ran, without a word); a
    varied key the plan sets itself made identical plans and named one the fastest; a varied key
    a flag also set (or a section holding it) overrode the flag silently; a bad profile or flag was reported as a bad config
    file."""
    base = ["plan", "--gpus", "4", "--seeds", "0", "--modes", "sync", "--out", str(tmp_path / "out")]
    profile = tmp_path / "bad.yaml"
    profile.write_text("rollout: {sim: {step_base_ms: -3, tensor_parallel_size: 1}}\n")
    cases = [
        (
            ["--accelerator", "nosuch", "--tflops-per-gpu", "1", "--kv-bytes-per-token", "1"],
            "--accelerator, --kv-bytes-per-token, --tflops-per-gpu: read only with --model-params-b",
        ),
        (["--mfu", "0.5"], "--mfu: read only with --model-params-b"),
        (["--vary", "rollout.num_replicas=1,8"], "--vary rollout.num_replicas: every plan sets it itself (from --gpus"),
        (["--vary", "trainer.seed=1,2"], "--vary trainer.seed: every plan sets it itself (from --seeds)"),
        (["--vary", "rollout.sim.time_scale=1,2"], "--vary rollout.sim.time_scale: every plan sets it itself"),
        (
            ["--steps", "2", "--vary", "trainer.total_steps=3,4"],
            "--vary trainer.total_steps: a flag given sets trainer.total_steps too",
        ),
        (  # a section given whole replaced the learner cost the model flag set in it
            ["--model-params-b", "7", "--vary", "trainer.sim_learner={seconds_per_step: 0.5},{seconds_per_step: 1}"],
            "--vary trainer.sim_learner: a flag given sets trainer.sim_learner.seconds_per_token too",
        ),
        (["--profile", str(profile)], f"profile {profile}: 1 validation error for SimEngineConfig\nstep_base_ms"),
        (["--steps", "0"], "invalid config with the command line's trainer.total_steps:"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_the_command_refuses_a_cluster_too_small_for_one_replica(capsys):
    code = main(["plan", "--gpus", "2", "--tp", "4", "--seeds", "0"])
    assert code == 2
    assert "must hold at least one replica of tp=4" in capsys.readouterr().err
    assert main(["plan", "--gpus", "4", "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err


def test_a_plan_prompts_with_the_configured_length_and_decodes_nothing(monkeypatch):
    """A plan's prompts are ``rollout.prompt_length`` tokens (prefill and KV cost follow from
    them), its GRPO siblings share theirs, and no response is decoded or scored."""
    import rollfleet.agent_loop.worker as worker_module

    def no_decoding(*_args, **_kwargs):
        raise AssertionError("a plan decoded a response")

    monkeypatch.setattr(worker_module, "model_text", no_decoding)
    spec = PlanSpec(workload_config(), gpus=2, modes=("sync",), seeds=(0,))
    config = spec.config_for("sync", 0)
    assert config.trainer.task == "synthetic" and config.rollout.sim.max_steps_per_wake > 1

    async def go():
        runtime = VirtualRuntime()
        trainer = get_trainer_cls("sync")(config, runtime=runtime)
        try:
            await trainer.init()
            await trainer.fit()
            assert runtime.fleet is not None
            return await runtime.fleet.report(), trainer.tracker.history
        finally:
            await trainer.close()

    report, history = virtual_time.run(go())
    requests = sum(report.requests.values())
    samples = config.trainer.total_steps * config.trainer.train_batch_size * config.rollout.n
    assert requests >= samples
    assert report.prompt_tokens == requests * config.rollout.prompt_length == requests * 64
    # Each group prompt is computed about once per replica it lands on, not once per sibling.
    assert report.prefill_tokens <= report.prompt_tokens / 2
    assert all(row["response_length/mean"] > 0 for row in history)


def test_a_synthetic_task_is_seeded_and_a_reward_given_outright_is_taken_as_is():
    from rollfleet.agent_loop.base import AgentLoopOutput
    from rollfleet.agent_loop.worker import AgentLoopWorker
    from rollfleet.trainer.tasks import make_task

    a, b = make_task("synthetic", seed=3, prompt_tokens=48), make_task("synthetic", seed=3, prompt_tokens=48)
    first, again = a.next(), b.next()
    assert first == again and len(first["prompt_ids"]) == 48 and first["reward"] == {"score": 0.0}
    assert a.next()["prompt_ids"] != first["prompt_ids"]
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # score() reads nothing else for such a reward
    out = AgentLoopOutput([1, 2], [5, 6], [1, 1], None)
    worker.score(out, {"reward": {"score": 0.75}})
    assert out.reward_score == 0.75


def test_the_command_refuses_an_out_it_cannot_write_and_keeps_varied_values_in_their_folders(tmp_path, capsys):
    """``--out`` a file was a NotADirectoryError traceback; a ``--vary`` value with a '/' nested
    folders (and '../..' wrote outside ``--out``)."""
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))
    args = ["plan", "--config", str(config), "--gpus", "2", "--seeds", "0", "--steps", "2", "--modes", "sync"]
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main([*args, "--out", str(out)]) == 2
        assert f"rollfleet plan: --out: {tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    out = tmp_path / "v" / "a"
    key = "trainer.learner.attn_implementation"  # a free string (the simulated learner reads none)
    assert main([*args, "--vary", f"{key}=../../esc,x/y", "--out", str(out)]) == 0
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == [f"{key}=.._.._esc", f"{key}=x_y"], folders
    assert not (tmp_path / "esc").exists() and not (tmp_path / "v" / "esc").exists()
    capsys.readouterr()
    assert main([*args, "--vary", f"{key}=x/y,x_y", "--out", str(out)]) == 2
    assert "name the same folder once made safe" in capsys.readouterr().err
    assert main([*args, "--vary", "trainr.total_steps=2,3", "--out", str(out)]) == 2  # two identical plans
    assert "--vary trainr.total_steps: 'trainr' is not a config section" in capsys.readouterr().err


def test_plans_that_vary_a_step_s_work_are_ranked_by_trained_tokens_per_second(tmp_path, capsys):
    """``--vary rollout.n=1,4``: four samples a prompt make a longer step that trains more per
    second; ranked by the step, the plan that trains least was named the fastest."""
    config = tmp_path / "plan.yaml"
    config.write_text(json.dumps(WORKLOAD))
    args = ["plan", "--config", str(config), "--gpus", "2", "--seeds", "0", "--steps", "3", "--modes", "sync"]
    assert main([*args, "--vary", "rollout.n=1,4", "--out", str(tmp_path / "n")]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "n" / "plan_variants.json").read_text())
    step = {r["plan"]: r["step_s"] for r in doc["rows"]}
    assert step["rollout.n=4"] > step["rollout.n=1"]  # the longer step ...
    assert doc["fastest"]["plan"] == "rollout.n=4"  # ... trains faster
    assert [r["tokens_per_s"] for r in doc["rows"]] == sorted((r["tokens_per_s"] for r in doc["rows"]), reverse=True)
    assert "fastest: sync, rollout.n=4" in printed and "trained tok/s" in printed
    assert "(tp 1), 3 steps x 1 seed, in virtual time" in printed  # was "(tp 1, 1) ... 1 seeds"


def test_the_fastest_split_is_the_one_that_trains_most_per_second():
    """It was the shortest step, while varied plans rank by trained tokens per second: one plan
    named two different splits fastest. A split whose fleet falls behind drops the long groups."""
    from rollfleet.plan.result import fastest_split

    rows = [
        {"mode": "sync", "step_s": 9.0, "tokens_per_s": 900.0},
        {"mode": "separate_async", "label": "1:3", "step_s": 2.8, "tokens_per_s": 1130.0},
        {"mode": "separate_async", "label": "2:2", "step_s": 3.0, "tokens_per_s": 1187.0},
    ]
    assert fastest_split(rows)["label"] == "2:2"
    rows[1]["tokens_per_s"] = 1187.0  # a tie in tokens: the shorter step
    assert fastest_split(rows)["label"] == "1:3"
    assert fastest_split(rows[:2]) is None  # one split: nothing to pick


def test_the_timeline_legend_names_what_shows_in_one_order():
    """Zero-width sync spans gave every timeline a "sync" entry with no bar of it, and the
    entries came in the order each run first met them."""
    from rollfleet.trainer.plots import legend_kinds

    spans = [
        {"lane": "trainer", "kind": "train", "start": 1.0, "end": 2.0},
        {"lane": "trainer", "kind": "sync", "start": 2.0, "end": 2.0},
        {"lane": "fleet", "kind": "generating", "start": 0.0, "end": 2.0},
        {"lane": "trainer", "kind": "wait", "start": 0.0, "end": 1.0},
        {"lane": "fleet", "kind": "custom", "start": 0.0, "end": 0.5},
    ]
    assert legend_kinds(spans) == ["wait", "train", "generating", "custom"]


def test_a_run_that_fails_stops_the_runs_still_going(tmp_path):
    """On two processes a failed run failed the plan only once the runs in progress had ended
    (minutes a run at scale): the pool's shutdown cancels what has not started, nothing more."""
    (tmp_path / "afile").write_text("")
    long = PlanSpec(
        workload_config(**{"trainer.total_steps": 2000}),
        gpus=4,
        modes=("sync",),
        seeds=(0,),
        output_dir=str(tmp_path / "long"),
    )
    broken = PlanSpec(workload_config(), gpus=4, modes=("sync",), seeds=(0,), output_dir=str(tmp_path / "afile"))
    with pytest.raises(OSError):  # its run folder cannot be made under a file
        run_plans([long, broken], workers=2, longest_first=False)
    metrics = list((tmp_path / "long").rglob("metrics.jsonl"))
    trained = len(metrics[0].read_text().splitlines()) if metrics else 0
    assert trained < 2000  # stopped, not waited for


def test_a_plan_of_another_engines_config_with_its_own_sim_context_builds_its_runs():
    """A vLLM config may give rollout.sim.max_model_len its own value (it is not the engine's
    context then); planned as the sim, the dump made both lengths given and they differed: the
    first run's config failed, telling the user to give one of them, though they gave one."""
    from rollfleet.config import RollfleetConfig
    from rollfleet.plan.spec import PlanSpec

    config = RollfleetConfig.model_validate({
        "rollout": {"name": "vllm", "sim": {"max_model_len": 4096}, "prompt_length": 100, "response_length": 100},
        "trainer": {"total_steps": 3},
    })  # fmt: skip
    planned = PlanSpec(config=config, gpus=2).config_for("sync", 0)
    assert planned.rollout.name == "sim" and planned.rollout.max_model_len == planned.rollout.sim.max_model_len == 200
