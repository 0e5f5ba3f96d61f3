"""Learner on the built-in tiny model (CPU, float32) and checkpoint files."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rollfleet.errors import InvalidRequest
from rollfleet.models import get_model_path
from rollfleet.trainer.checkpoint import (
    LATEST_FILE,
    capture_rng_state,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from rollfleet.trainer.learner import Learner, LearnerConfig

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return get_model_path("tiny")


def make_batch(prompt_lens, response_lens, P=5, R=6, seed=0, vocab=1000):
    """Prompts left-padded to P, responses right-padded to R, as the agent loop lays them out."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    input_ids = torch.full((B, P + R), 1020, dtype=torch.long)  # pad id (ignored by the masks)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        input_ids[i, P - p : P + r] = torch.randint(10, vocab, (p + r,), generator=g)
        attention_mask[i, P - p : P + r] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, P:].clone(),
        "response_mask": attention_mask[:, P:].clone(),
    }


def manual_log_probs(model, batch, i, P):
    """Row ``i`` without any padding through a plain forward; log_softmax at the right positions."""
    mask = batch["attention_mask"][i].bool()
    tokens = batch["input_ids"][i][mask]
    p_len = int(mask[:P].sum())
    r_len = int(batch["response_mask"][i].sum())
    with torch.no_grad():
        logits = model(input_ids=tokens[None]).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return torch.stack([logp[p_len + t - 1, tokens[p_len + t]] for t in range(r_len)])


def test_compute_log_probs_matches_manual_forward(tiny_path):
    learner = Learner(tiny_path, LearnerConfig(micro_batch_size=2))
    batch = make_batch([5, 2, 3], [6, 4, 1], P=5, R=6)
    got = learner.compute_log_probs(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"]
    )
    assert got.shape == (3, 6) and got.dtype == torch.float32
    for i in range(3):
        expected = manual_log_probs(learner.model, batch, i, P=5)
        torch.testing.assert_close(got[i, : len(expected)], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_gives_full_batch_gradient(tiny_path, agg):
    learner = Learner(tiny_path, LearnerConfig(micro_batch_size=4, loss={"loss_agg_mode": agg}))
    batch = make_batch([5, 2, 3, 4], [6, 2, 5, 1], seed=1)
    batch["advantages"] = torch.tensor([1.0, -2.0, 0.5, 3.0])[:, None] * batch["response_mask"]
    batch["rollout_log_probs"] = torch.full((4, 6), -7.0)
    prepared = learner.prepare(batch)

    def grads(micro: int):
        learner.config.micro_batch_size = micro
        learner.optimizer.zero_grad(set_to_none=True)
        metrics = learner.accumulate_gradients(prepared)
        return metrics, {n: p.grad.clone() for n, p in learner.model.named_parameters()}

    full_metrics, full = grads(4)
    micro_metrics, micro = grads(1)
    assert micro_metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-5)
    for name in full:
        torch.testing.assert_close(micro[name], full[name], atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in full.values())


def test_update_raises_log_prob_of_token_with_positive_advantage(tiny_path):
    learner = Learner(tiny_path, LearnerConfig(lr=1e-3))
    batch = make_batch([3], [5], seed=2)
    batch["advantages"] = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])  # only token 2 is rewarded
    args = [batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")]
    before = learner.compute_log_probs(*args)
    metrics = learner.update(batch)
    after = learner.compute_log_probs(*args)
    assert after[0, 2] > before[0, 2] + 1e-3
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0)  # first step clips around the same policy
    assert learner.global_step == 1


def test_grpo_update_moves_winner_up_and_loser_down(tiny_path):
    learner = Learner(tiny_path, LearnerConfig(lr=1e-3, ppo_epochs=2, mini_batch_size=1, micro_batch_size=1))
    batch = make_batch([4, 4], [5, 5], seed=3)
    batch.update(scores=torch.tensor([1.0, 0.0]), uids=["q", "q"], rollout_log_probs=torch.zeros(2, 6) - 5)
    args = [batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")]
    m = batch["response_mask"].float()
    before = (learner.compute_log_probs(*args) * m).sum(-1)
    metrics = learner.update(batch)
    after = (learner.compute_log_probs(*args) * m).sum(-1)
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["actor/skipped_steps"] == 0.0
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/ratio_max", "actor/grad_norm"} <= set(metrics)


def test_bfloat16_compute_keeps_float32_master_weights_so_small_updates_land(tiny_path, tmp_path):
    """Parameters held in bfloat16 lost an AdamW step of lr 1e-6 below their resolution (a weight
    of ~0.016 moves in steps of 6e-5): 1.5% of the elements moved over three updates, against 78%
    in float32. The parameters and the optimizer stay float32; bfloat16 is the computation's, and
    the weights the engines get; a checkpoint keeps the float32 masters for a resume."""
    batch = make_batch([5, 4, 3, 5], [6, 5, 4, 6], seed=1)
    batch.update(uids=["a", "a", "b", "b"], scores=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    moved = {}
    for dtype in ("float32", "bfloat16"):
        learner = Learner(tiny_path, LearnerConfig(dtype=dtype, lr=1e-6, weight_decay=0.0))
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        for _ in range(3):
            assert learner.update(batch)["actor/skipped_steps"] == 0.0
        total = sum(p.numel() for p in learner.model.parameters())
        moved[dtype] = sum(int((before[n] != p.detach()).sum()) for n, p in learner.model.named_parameters()) / total
    assert moved["float32"] > 0.5 and moved["bfloat16"] > 0.5, moved
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert {t.dtype for t in learner.state_dict_for_inference().values()} == {torch.bfloat16}
    folder = learner.save(tmp_path / "ckpt")
    fresh = Learner(tiny_path, LearnerConfig(dtype="bfloat16"))
    fresh.load(folder)
    for (n, a), (_, b) in zip(learner.model.named_parameters(), fresh.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_an_unknown_rollout_log_prob_costs_its_token_the_correction_not_the_step(tiny_path):
    """A NaN rollout log prob (the engine gave none), even off the mask where it was multiplied by
    0, made the loss NaN and the step was skipped: every other sample's signal lost. The proximal
    log prob now stands in for it (weight 1), and the update equals one given exactly that."""
    batch = make_batch([4, 4], [5, 3], seed=3)
    batch.update(scores=torch.tensor([1.0, 0.0]), uids=["q", "q"])
    rollout = torch.full((2, 6), -3.0)
    unknown = rollout.clone()
    unknown[0, 2] = float("nan")  # on the mask
    unknown[1, 5] = float("nan")  # off it
    runs = {}
    for name, values in (("unknown", unknown), ("given", None)):
        learner = Learner(tiny_path, LearnerConfig(lr=1e-3, loss={"behav_imp_weight_cap": 5.0}))
        if values is None:  # the same batch with the proximal log prob given where it was unknown
            args = [batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")]
            values = torch.where(torch.isnan(unknown), learner.compute_log_probs(*args), rollout)
        metrics = learner.update({**batch, "rollout_log_probs": values})
        assert metrics["actor/skipped_steps"] == 0.0 and math.isfinite(metrics["actor/loss"]), name
        runs[name] = (metrics, [p.detach().clone() for p in learner.model.parameters()])
    assert runs["unknown"][0]["actor/rollout_log_probs_unknown"] == 1.0
    assert runs["given"][0]["actor/rollout_log_probs_unknown"] == 0.0
    for a, b in zip(runs["unknown"][1], runs["given"][1]):
        torch.testing.assert_close(a, b)


def test_a_mini_batch_with_no_token_in_the_loss_takes_no_optimizer_step(tiny_path):
    """Every row masked (stale, unscored, exhausted): the gradient is zero, yet AdamW's momentum and
    weight decay moved the weights (by more than the learning rate) and the step counted as taken."""
    learner = Learner(tiny_path, LearnerConfig(lr=1e-3))
    batch = make_batch([3, 4], [5, 2], seed=4)
    batch["advantages"] = torch.tensor([[1.0], [-1.0]]) * batch["response_mask"]
    learner.update(batch)  # momentum to carry
    before = [p.detach().clone() for p in learner.model.parameters()]
    masked = {**batch, "response_mask": torch.zeros_like(batch["response_mask"])}
    metrics = learner.update(masked)
    assert metrics["actor/skipped_steps"] == 1.0 and metrics["actor/num_tokens"] == 0.0
    for a, b in zip(before, learner.model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_bad_batch_is_rejected_with_field_named(tiny_path):
    learner = Learner(tiny_path, LearnerConfig())
    batch = make_batch([3], [4])
    batch["advantages"] = torch.zeros(1, 6)
    bad = dict(batch, responses=batch["responses"] + 1)
    with pytest.raises(InvalidRequest) as err:
        learner.update(bad)
    assert err.value.field == "batch.responses"
    with pytest.raises(InvalidRequest) as err:
        learner.update({k: v for k, v in batch.items() if k != "advantages"})
    assert err.value.field == "batch.scores"
    # a NaN score made its group's advantages, the loss and the step NaN: refused, naming the row
    nan = {**batch, "advantages": None, "scores": torch.tensor([float("nan")]), "uids": ["q"]}
    with pytest.raises(InvalidRequest, match=r"rows \[0\]") as err:
        learner.update(nan)
    assert err.value.field == "batch.scores"


def test_config_rejects_unknown_estimator_and_options():
    with pytest.raises(ValueError, match="valid names: .*grpo"):
        LearnerConfig(adv_estimator="nope")
    with pytest.raises(ValueError, match="norm_adv_by_std"):
        LearnerConfig(adv_options={"norm_by_std": False})


def test_an_estimators_plain_keyword_argument_is_an_option():
    """``fn(scores, uids, response_mask, scale=1.0)`` works when called with ``scale=``, yet the
    config refused the option (only keyword-only ones counted); the three inputs are never options."""
    from rollfleet.trainer.advantage_registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    def scaled(scores, uids, response_mask, scale=1.0):
        return scores[:, None] * response_mask * scale

    register_advantage_estimator("test_scaled", scaled)
    try:
        assert LearnerConfig(adv_estimator="test_scaled", adv_options={"scale": 2.0}).adv_options == {"scale": 2.0}
        with pytest.raises(ValueError, match=r"no option\(s\) \['uids'\]; valid options: \['scale'\]"):
            LearnerConfig(adv_estimator="test_scaled", adv_options={"uids": 1})
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_scaled")


def _safetensors_keys(folder: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_state_dict_for_inference_matches_safetensors_names(tiny_path):
    learner = Learner(tiny_path, LearnerConfig())
    state = learner.state_dict_for_inference()
    assert set(state) == _safetensors_keys(tiny_path)
    for t in state.values():
        assert t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
    name = "model.embed_tokens.weight"
    state[name].add_(1.0)  # a copy: the model is untouched
    assert not torch.equal(state[name], learner.model.state_dict()[name])


def test_state_dict_for_inference_drops_tied_lm_head(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=128,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    state = Learner(str(tmp_path), LearnerConfig()).state_dict_for_inference()
    assert "lm_head.weight" not in state
    assert set(state) == _safetensors_keys(str(tmp_path))


def test_checkpoint_round_trip_restores_params_optimizer_step(tiny_path, tmp_path):
    learner = Learner(tiny_path, LearnerConfig())
    batch = make_batch([3, 4], [5, 2], seed=4)
    batch["advantages"] = torch.tensor([[1.0], [-1.0]]) * batch["response_mask"]
    learner.update(batch)
    learner.update(batch)
    trainer_state = {"data_position": 17, "in_flight": ["p3", "p9"], "rng": capture_rng_state()}
    folder = learner.save(tmp_path / "ckpt", trainer_state=trainer_state)
    assert folder.name == "step_00000002"

    fresh = Learner(tiny_path, LearnerConfig())
    assert fresh.load(tmp_path / "ckpt") == json.loads(json.dumps(trainer_state))
    assert fresh.global_step == 2
    for (n, a), (_, b) in zip(learner.model.named_parameters(), fresh.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    sa, sb = learner.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa["state"][k][field], sb["state"][k][field], rtol=0, atol=0)
    # the checkpoint is also a model folder transformers can load
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(folder))
    torch.testing.assert_close(reloaded.state_dict()["lm_head.weight"], learner.model.state_dict()["lm_head.weight"])


def _tiny_state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), v)}


def test_latest_pointer_and_keep_last(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _tiny_state(step), trainer_state={"s": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert (tmp_path / LATEST_FILE).read_text().strip() == "step_00000005"
    assert find_latest(tmp_path).name == "step_00000005"
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 5 and ckpt.trainer_state == {"s": 5} and ckpt.optimizer_state is None
    torch.testing.assert_close(ckpt.model_state["w"], _tiny_state(5)["w"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_find_latest_survives_crash_between_rename_and_pointer(tmp_path):
    save_checkpoint(tmp_path, 1, _tiny_state(1))
    save_checkpoint(tmp_path, 2, _tiny_state(2))
    (tmp_path / LATEST_FILE).write_text("step_00000001\n")  # pointer update lost
    (tmp_path / ".tmp-step_00000003-x").mkdir()  # a torn write: ignored
    assert find_latest(tmp_path).name == "step_00000002"
    (tmp_path / LATEST_FILE).unlink()
    assert find_latest(tmp_path).name == "step_00000002"
    assert find_latest(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing")


def test_resave_same_step_and_non_json_state(tmp_path):
    save_checkpoint(tmp_path, 3, _tiny_state(1))
    save_checkpoint(tmp_path, 3, _tiny_state(2))
    torch.testing.assert_close(load_checkpoint(tmp_path).model_state["w"], _tiny_state(2)["w"])
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 4, _tiny_state(4), trainer_state={"bad": object()})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003"]


def test_the_simulated_learner_checkpoints_like_the_real_one(tmp_path):
    """A plan's learner keeps the last few checkpoints, written atomically, and a resume gets its
    step and the tokens it trained back: it kept every checkpoint, wrote each in place (a crash
    between its files left a torn one, a non-JSON state half a folder) and lost the token count."""
    from types import SimpleNamespace

    from rollfleet.trainer.config import SimLearnerConfig
    from rollfleet.trainer.sim_learner import SimulatedLearner

    learner = SimulatedLearner(SimLearnerConfig(enabled=True, seconds_per_token=0.0))
    batch = SimpleNamespace(attention_mask=torch.ones(2, 5))
    for step in range(1, 6):
        learner.step(batch)
        learner.save(tmp_path, {"s": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004", "step_00000005"]
    with pytest.raises(TypeError):
        learner.save(tmp_path, {"bad": object()})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    resumed = SimulatedLearner(SimLearnerConfig(enabled=True))
    assert resumed.load(tmp_path) == {"s": 5}
    assert (resumed.global_step, resumed.trained_tokens) == (5, 50)


def test_rng_state_round_trip():
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_batch_from_dataclass_with_verl_uid_name():
    from dataclasses import make_dataclass

    from rollfleet.trainer.learner import LearnerBatch

    fields_ = make_batch([2, 2], [3, 3])
    Rollout = make_dataclass("Rollout", [*fields_, "scores", "uid", "prompts"])
    rb = Rollout(**fields_, scores=[1.0, 0.0], uid=["g", "g"], prompts=None)
    lb = LearnerBatch.from_any(rb)
    assert lb.uids == ["g", "g"] and lb.scores.dtype == torch.float32 and lb.advantages is None
