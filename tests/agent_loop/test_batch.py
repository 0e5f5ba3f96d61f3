"""RolloutBatch: padding and shapes for ragged trajectories, rewards, versions, group ids."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.agent_loop import AgentLoopOutput, collate
from rollfleet.agent_loop.base import AgentLoopMetrics
from rollfleet.agent_loop.batch import PADDED_FIELDS
from rollfleet.agent_loop.manager import as_samples, expand_groups

pytestmark = pytest.mark.unit

PAD = 3


def traj(prompt_len, response_mask, reward=None, versions=(None, None), logprobs=True, gen=0.0):
    resp = [100 + i for i in range(len(response_mask))]
    return AgentLoopOutput(
        prompt_ids=[10 + i for i in range(prompt_len)],
        response_ids=resp,
        response_mask=list(response_mask),
        response_logprobs=[-0.5 if m else 0.0 for m in response_mask] if logprobs else None,
        num_turns=3,
        reward_score=reward,
        metrics=AgentLoopMetrics(generate_sequences=gen),
        extra_fields={"min_global_steps": versions[0], "max_global_steps": versions[1]},
    )


def test_ragged_padding_and_shapes():
    outs = [
        traj(2, [1, 1, 0, 1], reward=1.0, versions=(0, 2), gen=1.0),
        traj(5, [1], reward=0.0, gen=3.0),
        traj(1, [], reward=0.5),
        traj(7, [1] * 9),
    ]
    batch = collate(outs, ["g0", "g0", "g1", "g1"], prompt_length=6, response_length=8, pad_token_id=PAD)
    b, p, r = 4, 6, 8
    assert batch.prompts.shape == (b, p) and batch.responses.shape == (b, r)
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.position_ids.shape == (b, p + r)
    assert batch.rollout_log_probs.dtype == torch.float32 and batch.rollout_log_probs.shape == (b, r)
    assert batch.prompts[0].tolist() == [PAD] * 4 + [10, 11]  # left-padded
    assert batch.prompts[3].tolist() == [11, 12, 13, 14, 15, 16]  # too long: cut on the left
    assert batch.responses[0].tolist() == [100, 101, 102, 103] + [PAD] * 4  # right-padded
    assert batch.responses[3].tolist() == list(range(100, 108))  # too long: cut on the right
    assert batch.response_mask[0].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert batch.attention_mask[0].tolist() == [0] * 4 + [1] * 2 + [1] * 4 + [0] * 4
    assert batch.position_ids[0].tolist() == [0] * 4 + [0, 1, 2, 3, 4, 5] + [5] * 4
    assert batch.rollout_log_probs[0].tolist() == [-0.5, -0.5, 0.0, -0.5, 0, 0, 0, 0]
    assert batch.rm_scores[0].tolist() == [0, 0, 0, 1.0, 0, 0, 0, 0]  # on the last response token
    assert batch.scores.tolist() == [1.0, 0.0, 0.5, 0.0] and batch.has_score.tolist() == [True, True, True, False]
    assert batch.rm_scores[2].sum() == 0  # empty response: reward only in scores
    assert batch.prompt_lengths.tolist() == [2, 5, 1, 6] and batch.response_lengths.tolist() == [4, 1, 0, 8]
    assert batch.min_global_steps.tolist() == [0, -1, -1, -1] and batch.max_global_steps.tolist() == [2, -1, -1, -1]
    assert batch.group_index.tolist() == [0, 0, 1, 1] and batch.uid == ["g0", "g0", "g1", "g1"]
    assert torch.equal(batch.input_ids, torch.cat([batch.prompts, batch.responses], 1))
    assert batch.metrics["agent_loop/generate_sequences/max"] == 3.0
    assert batch.metrics["agent_loop/slowest/generate_sequences"] == 3.0
    assert batch.metrics["agent_loop/slowest/response_length"] == 1.0
    assert len(batch) == 4 and "rollout_log_probs" in batch.tensors()


def test_a_trajectory_without_logprobs_is_unknown_there_and_the_others_keep_theirs():
    """One sample without logprobs used to drop every sample's (no decoupled-PPO correction for
    the batch, without a word); its row is NaN on its mask now (the learner takes the proximal
    log prob there), 0.0 off every mask, NaN included. None only when no sample has any."""
    nan_off_mask = traj(1, [1, 0])
    nan_off_mask.response_logprobs = [-0.25, float("nan")]
    outs = [traj(1, [1]), traj(1, [1, 1], logprobs=False), nan_off_mask]
    batch = collate(outs, ["a", "b", "c"], prompt_length=2, response_length=2, pad_token_id=PAD)
    rows = batch.rollout_log_probs.tolist()
    assert rows[0] == [-0.5, 0.0] and all(math.isnan(x) for x in rows[1]) and rows[2] == [-0.25, 0.0]
    none = collate([traj(1, [1], logprobs=False)] * 2, ["a", "b"], prompt_length=2, response_length=2, pad_token_id=PAD)
    assert none.rollout_log_probs is None


def test_groups_share_uid():
    samples = expand_groups(as_samples({"prompt_ids": [[1], [2], [3]]}), n=4)
    assert len(samples) == 12
    uids = [s["uid"] for s in samples]
    assert len(set(uids)) == 3 and all(uids[4 * g : 4 * g + 4] == [uids[4 * g]] * 4 for g in range(3))
    assert [s["sample_index"] for s in samples[:4]] == [0, 1, 2, 3]
    det = expand_groups([{"prompt_ids": [1]}], n=2, deterministic=True)
    assert [s["request_id"] for s in det] == ["det-0-0", "det-0-1"]
    # a sample's own id names one trajectory: each copy is one (its session, its tools' instances)
    given = expand_groups([{"prompt_ids": [1], "request_id": "row-17"}], n=3, deterministic=True)
    assert [s["request_id"] for s in given] == ["row-17-0", "row-17-1", "row-17-2"]
    assert expand_groups([{"prompt_ids": [1], "request_id": "row-17"}], n=1)[0]["request_id"] == "row-17"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.lists(st.sampled_from([0, 1]), max_size=12)), min_size=1, max_size=6))
def test_padding_invariants(items):
    outs = [traj(p, m, reward=1.0) for p, m in items]
    batch = collate(outs, [str(i) for i in range(len(outs))], prompt_length=8, response_length=10, pad_token_id=PAD)
    for i, (p, m) in enumerate(items):
        lp, lr = min(p, 8), min(len(m), 10)
        assert batch.attention_mask[i].sum() == lp + lr
        assert batch.response_mask[i].tolist() == m[:lr] + [0] * (10 - lr)
        assert (batch.rollout_log_probs[i] != 0).sum() == sum(m[:lr])
        assert batch.rm_scores[i].sum() == (1.0 if lr else 0.0)
        assert batch.position_ids[i, 8] == (lp if lr else max(lp - 1, 0))


def test_token_versions_exact_where_known_and_conservative_where_not():
    exact = traj(2, [1, 1, 0, 1], versions=(3, 5))
    exact.response_versions = [3, 4, -1, 5]  # the tool token in the middle was not sampled
    unknown = traj(2, [1, 1, 1], versions=(2, 4))  # the fleet said only first and last
    exhausted = traj(2, [1, 1], versions=(1, 1))
    exhausted.extra_fields["resume_exhausted"] = True
    batch = collate([exact, unknown, exhausted], ["a", "b", "c"], prompt_length=4, response_length=5, pad_token_id=PAD)
    assert batch.token_versions.tolist() == [
        [3, 4, -1, 5, -1],
        [2, 2, 2, -1, -1],  # the oldest it may be: a staleness bound on it errs on the safe side
        [1, 1, -1, -1, -1],
    ]
    assert batch.resume_exhausted.tolist() == [False, False, True]


def test_response_versions_must_align_with_the_response():
    with pytest.raises(ValueError, match="response_versions"):
        AgentLoopOutput([1], [5, 6], [1, 1], response_versions=[0])


def test_rows_filled_in_one_go_equal_rows_copied_token_by_token():
    # siblings with one prompt, an all-model mask, one weight version: the rows collate fills in C
    first, second, tool = traj(3, [1, 1, 1]), traj(3, [1, 1, 1, 1]), traj(3, [1, 0, 1])
    first.response_versions, second.response_versions, tool.response_versions = [7] * 3, [7] * 4, [7, -1, 7]
    second.prompt_ids = list(first.prompt_ids)
    batch = collate([first, second, tool], ["g", "g", "g"], prompt_length=5, response_length=4, pad_token_id=PAD)
    assert batch.prompts.tolist() == [[PAD, PAD, 10, 11, 12]] * 3
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 0]]
    assert batch.token_versions.tolist() == [[7, 7, 7, -1], [7, 7, 7, 7], [7, -1, 7, -1]]


def test_padded_fields_are_built_on_first_read_and_a_change_to_them_stays():
    outs = [traj(2, [1, 1, 0], reward=1.0), traj(3, [1], reward=0.0)]
    batch = collate(outs, ["g", "g"], prompt_length=4, response_length=5, pad_token_id=PAD)
    assert batch.padded_tensors is None  # the per-sample fields alone so far
    assert batch.response_lengths.tolist() == [3, 1] and batch.scores.tolist() == [1.0, 0.0]
    batch.response_mask[1] = 0  # the trainer masks a sample out
    assert batch.padded_tensors is not None and batch.rows is None
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 0], [0] * 5]  # kept, not rebuilt
    assert batch.attention_mask.sum(dim=1).tolist() == [5, 4]
    assert set(batch.tensors()) >= {"input_ids", "token_versions", "scores", "group_index"}
    assert set(batch.padded()) == set(PADDED_FIELDS)  # every padded field is built, and only those


def test_a_pickled_batch_carries_its_padded_tensors():
    import pickle

    batch = collate([traj(2, [1, 1], reward=1.0)], ["g"], prompt_length=3, response_length=4, pad_token_id=PAD)
    copy = pickle.loads(pickle.dumps(batch))
    assert copy.rows is None and copy.padded_tensors is not None
    assert copy.responses.tolist() == [[100, 101, PAD, PAD]]
    assert copy.rm_scores.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert torch.equal(copy.input_ids, batch.input_ids)
