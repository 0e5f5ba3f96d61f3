"""``RolloutBatch``: finished trajectories padded into the tensors a trainer consumes.

Layout (verl's): prompts left-padded to ``prompt_length`` and responses right-padded to
``response_length``, so that ``input_ids = [prompts | responses]`` puts every prompt's last token
at column ``prompt_length - 1`` and every response's first token at ``prompt_length``. Shapes, with
``B`` samples, ``P = prompt_length``, ``R = response_length``:

=====================  ===========  ========  ===================================================
field                  shape        dtype     meaning
=====================  ===========  ========  ===================================================
prompts                [B, P]       int64     prompt ids, left-padded with ``pad_token_id``
responses              [B, R]       int64     response ids (model + tool tokens), right-padded
response_mask          [B, R]       int64     1 = model token (trained on), 0 = tool/user/pad
input_ids              [B, P+R]     int64     ``cat(prompts, responses)``
attention_mask         [B, P+R]     int64     1 on real (non-pad) tokens
position_ids           [B, P+R]     int64     ``cumsum(attention_mask) - 1``, 0 on left pads
rollout_log_probs      [B, R]       float32   sampling logprobs, 0.0 off the mask (None if off)
rm_scores              [B, R]       float32   the reward on the last response token, 0 elsewhere
scores                 [B]          float32   the per-sample reward (0.0 when none: see has_score)
has_score              [B]          bool      whether a reward was computed for the sample
prompt_lengths         [B]          int64     real prompt tokens
response_lengths       [B]          int64     real response tokens
num_turns              [B]          int64     user + assistant turns + 1 (verl's count)
min_global_steps       [B]          int64     weight version of the first model token (-1: unknown)
max_global_steps       [B]          int64     weight version of the last model token (-1: unknown)
token_versions         [B, R]       int64     weight version that sampled each model token; where the
                                              fleet did not say, the sample's min_global_steps (the
                                              oldest it may be); -1 off the mask or unknown
resume_exhausted       [B]          bool      a request gave up resuming: the response is a partial
group_index            [B]          int64     0..G-1: which GRPO group a sample belongs to
uid                    list[str]              group id (equal for the ``n`` samples of a prompt)
extra_fields           list[dict]             each trajectory's ``extra_fields``
metrics                dict                   timing metrics (see :func:`timing_metrics`)
=====================  ===========  ========  ===================================================

A sample with an empty response has its reward only in ``scores`` (there is no last token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional, Sequence

from rollfleet.agent_loop.base import AgentLoopMetrics, AgentLoopOutput

if TYPE_CHECKING:  # torch is imported where batches are built: workers never need it
    import torch


@dataclass
class RolloutBatch:
    prompts: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor]
    rm_scores: torch.Tensor
    scores: torch.Tensor
    has_score: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    num_turns: torch.Tensor
    min_global_steps: torch.Tensor
    max_global_steps: torch.Tensor
    token_versions: torch.Tensor
    resume_exhausted: torch.Tensor
    group_index: torch.Tensor
    uid: list[str]
    extra_fields: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (``rollout_log_probs`` left out when None)."""
        import torch

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
        return out


def _version(value: Any) -> int:
    return -1 if value is None else int(value)


def collate(
    outputs: Sequence[AgentLoopOutput],
    uids: Sequence[str],
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
) -> RolloutBatch:
    """Pad trajectories into a :class:`RolloutBatch` (prompts cut on the left and responses on the
    right if a loop returned more than the widths allow)."""
    import numpy as np
    import torch

    if len(outputs) != len(uids):
        raise ValueError(f"{len(outputs)} outputs for {len(uids)} uids")
    b, p, r = len(outputs), prompt_length, response_length
    # Filled row by row in numpy (a list into a numpy slice is several times cheaper than a torch
    # tensor built per row; it adds up at thousands of rows), shared with torch at the end.
    prompts = np.full((b, p), pad_token_id, dtype=np.int64)
    responses = np.full((b, r), pad_token_id, dtype=np.int64)
    response_mask = np.zeros((b, r), dtype=np.int64)
    prompt_lengths = np.zeros(b, dtype=np.int64)
    response_lengths = np.zeros(b, dtype=np.int64)
    with_logprobs = bool(outputs) and all(o.response_logprobs is not None for o in outputs)
    logprobs = np.zeros((b, r), dtype=np.float32) if with_logprobs else None
    rm_scores = np.zeros((b, r), dtype=np.float32)
    scores = np.zeros(b, dtype=np.float32)
    has_score = np.zeros(b, dtype=bool)
    num_turns = np.zeros(b, dtype=np.int64)
    min_steps = np.full(b, -1, dtype=np.int64)
    max_steps = np.full(b, -1, dtype=np.int64)
    token_versions = np.full((b, r), -1, dtype=np.int64)
    exhausted = np.zeros(b, dtype=bool)
    group_of: dict[str, int] = {}
    group_index = np.array([group_of.setdefault(u, len(group_of)) for u in uids], dtype=np.int64)

    # Copying a list into numpy converts it one element at a time (~50 ns each, several arrays of
    # a million tokens a step); rows that repeat the row before (GRPO siblings' prompts) or hold
    # one value (an all-model mask, one weight version) are filled in C instead.
    previous: list[int] = []
    for i, out in enumerate(outputs):
        prompt = out.prompt_ids[-p:] if p else []
        lp, lr = len(prompt), min(len(out.response_ids), r)
        if lp:
            if i and prompt == previous:
                prompts[i] = prompts[i - 1]
            else:
                prompts[i, p - lp :] = prompt
        previous = prompt
        if lr:
            responses[i, :lr] = out.response_ids[:lr]
            mask = out.response_mask[:lr]
            response_mask[i, :lr] = 1 if mask.count(1) == lr else mask
            if logprobs is not None:
                logprobs[i, :lr] = out.response_logprobs[:lr]  # type: ignore[index]
        if out.reward_score is not None:
            scores[i] = float(out.reward_score)
            has_score[i] = True
            if lr:
                rm_scores[i, lr - 1] = float(out.reward_score)
        prompt_lengths[i], response_lengths[i] = lp, lr
        num_turns[i] = out.num_turns
        min_steps[i] = _version(out.extra_fields.get("min_global_steps"))
        max_steps[i] = _version(out.extra_fields.get("max_global_steps"))
        exhausted[i] = bool(out.extra_fields.get("resume_exhausted"))
        if lr:
            if out.response_versions is not None:
                labels = out.response_versions[:lr]
                token_versions[i, :lr] = labels[0] if labels.count(labels[0]) == lr else labels
            row = token_versions[i, :lr]
            row[row < 0] = min_steps[i]

    prompt_attn = (np.arange(p) >= p - prompt_lengths[:, None]).astype(np.int64)
    response_attn = (np.arange(r) < response_lengths[:, None]).astype(np.int64)
    response_mask *= response_attn
    token_versions[response_mask == 0] = -1
    if logprobs is not None:
        logprobs *= response_mask
    arrays = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": np.concatenate([prompt_attn, response_attn], axis=1),
        "rm_scores": rm_scores,
        "scores": scores,
        "has_score": has_score,
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
        "num_turns": num_turns,
        "min_global_steps": min_steps,
        "max_global_steps": max_steps,
        "token_versions": token_versions,
        "resume_exhausted": exhausted,
        "group_index": group_index,
    }
    tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}  # shared, not copied
    return RolloutBatch(
        **tensors,
        position_ids=(torch.cumsum(tensors["attention_mask"], dim=1) - 1).clamp(min=0),
        rollout_log_probs=None if logprobs is None else torch.from_numpy(logprobs),
        uid=list(uids),
        extra_fields=[dict(o.extra_fields) for o in outputs],
        metrics=timing_metrics(outputs),
    )


def timing_metrics(outputs: Sequence[AgentLoopOutput]) -> dict[str, float]:
    """``agent_loop/<metric>/{min,mean,max}`` over trajectories for every per-loop metric, and
    ``agent_loop/slowest/*`` for the trajectory that spent longest generating plus in tools (the
    one that held the batch up)."""
    if not outputs:
        return {}
    out: dict[str, float] = {}
    names = [f.name for f in fields(AgentLoopMetrics)]
    for name in names:
        values = [float(getattr(o.metrics, name)) for o in outputs]
        out[f"agent_loop/{name}/min"] = min(values)
        out[f"agent_loop/{name}/mean"] = sum(values) / len(values)
        out[f"agent_loop/{name}/max"] = max(values)
    slowest = max(outputs, key=lambda o: o.metrics.generate_sequences + o.metrics.tool_calls)
    out["agent_loop/slowest/generate_sequences"] = slowest.metrics.generate_sequences
    out["agent_loop/slowest/tool_calls"] = slowest.metrics.tool_calls
    out["agent_loop/slowest/num_turns"] = float(slowest.num_turns)
    out["agent_loop/slowest/prompt_length"] = float(len(slowest.prompt_ids))
    out["agent_loop/slowest/response_length"] = float(len(slowest.response_ids))
    out["agent_loop/slowest/num_resumes"] = float(slowest.metrics.num_resumes)
    return out


__all__ = ["RolloutBatch", "collate", "timing_metrics"]
