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
rollout_log_probs      [B, R]       float32   sampling logprobs, 0.0 off the mask, NaN where the engine
                                              gave none (None when no sample has any)
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
The ``[B, P]``, ``[B, R]`` and ``[B, P+R]`` fields are built when one of them is first read (see
:class:`RolloutBatch`); the rest with the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional, Sequence

from rollfleet.agent_loop.base import AgentLoopMetrics, AgentLoopOutput

if TYPE_CHECKING:  # torch is imported where batches are built: workers never need it
    import torch


class _Padded:
    """A padded field of :class:`RolloutBatch`: read from the padded tensors, built on first read."""

    name: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, batch: Optional["RolloutBatch"], owner: type) -> Any:
        if batch is None:
            return self
        return batch.padded()[self.name]


@dataclass
class RolloutBatch:
    """A batch of trajectories. The per-sample fields are built with the batch; the padded ones
    (:data:`PADDED_FIELDS`) when one is first read, all at once. Why: they hold ``B x R`` elements
    whatever the responses' lengths, most of a batch's cost when ``R`` is long (2,048 responses
    padded to 28K tokens are 0.46 GB per int64 field, and collating them took over half of a plan's
    wall time), and a consumer that needs only lengths and rewards (the simulated learner, the
    trainer's bookkeeping) never pays for them. Once built they are ordinary tensors: a change to
    one (the trainer zeroing ``response_mask`` rows) stays. Pickling builds them first, so a remote
    learner receives tensors."""

    scores: torch.Tensor
    has_score: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    num_turns: torch.Tensor
    min_global_steps: torch.Tensor
    max_global_steps: torch.Tensor
    resume_exhausted: torch.Tensor
    group_index: torch.Tensor
    uid: list[str]
    extra_fields: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    rows: Optional["_Rows"] = field(default=None, repr=False, compare=False)
    padded_tensors: Optional[dict[str, Any]] = field(default=None, repr=False, compare=False)

    prompts = _Padded()
    responses = _Padded()
    response_mask = _Padded()
    input_ids = _Padded()
    attention_mask = _Padded()
    position_ids = _Padded()
    rollout_log_probs = _Padded()
    rm_scores = _Padded()
    token_versions = _Padded()

    def __len__(self) -> int:
        return len(self.uid)

    def padded(self) -> dict[str, Any]:
        """The padded fields by name, built on the first call (the trajectories are let go then)."""
        if self.padded_tensors is None:
            assert self.rows is not None, "a RolloutBatch without padded tensors needs its rows"
            self.padded_tensors = self.rows.pad()
            self.rows = None
        return self.padded_tensors

    def __getstate__(self) -> dict[str, Any]:
        self.padded()
        return dict(self.__dict__)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, padded ones included (``rollout_log_probs`` left out when None)."""
        import torch

        out = {name: value for name, value in self.padded().items() if value is not None}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
        return out


#: The fields of shape [B, P], [B, R] or [B, P+R], built together on first read (see RolloutBatch).
PADDED_FIELDS: tuple[str, ...] = tuple(name for name, v in vars(RolloutBatch).items() if isinstance(v, _Padded))


def _version(value: Any) -> int:
    return -1 if value is None else int(value)


@dataclass
class _Rows:
    """What the padded fields are built from: the trajectories, the widths, and the per-sample
    values they use (copies: a consumer may change the batch's own tensors first)."""

    outputs: tuple[AgentLoopOutput, ...]
    prompt_length: int
    response_length: int
    pad_token_id: int
    prompt_lengths: Any  # numpy int64 [B]
    response_lengths: Any
    scores: Any  # numpy float32 [B]
    has_score: Any
    min_steps: Any
    with_logprobs: bool

    def pad(self) -> dict[str, Any]:
        import numpy as np
        import torch

        b, p, r = len(self.outputs), self.prompt_length, self.response_length
        # Filled row by row in numpy (a list into a numpy slice is several times cheaper than a
        # torch tensor built per row; it adds up at thousands of rows), shared with torch at the end.
        prompts = np.full((b, p), self.pad_token_id, dtype=np.int64)
        responses = np.full((b, r), self.pad_token_id, dtype=np.int64)
        response_mask = np.zeros((b, r), dtype=np.int64)
        logprobs = np.zeros((b, r), dtype=np.float32) if self.with_logprobs else None
        token_versions = np.full((b, r), -1, dtype=np.int64)
        # Copying a list into numpy converts it one element at a time (~50 ns each, several arrays
        # of a million tokens a step); rows that repeat the row before (GRPO siblings' prompts) or
        # hold one value (an all-model mask, one weight version) are filled in C instead.
        previous: list[int] = []
        for i, out in enumerate(self.outputs):
            prompt = out.prompt_ids[-p:] if p else []
            lp, lr = int(self.prompt_lengths[i]), int(self.response_lengths[i])
            if lp:
                if i and prompt == previous:
                    prompts[i] = prompts[i - 1]
                else:
                    prompts[i, p - lp :] = prompt
            previous = prompt
            if not lr:
                continue
            responses[i, :lr] = out.response_ids[:lr]
            mask = out.response_mask[:lr]
            response_mask[i, :lr] = 1 if mask.count(1) == lr else mask
            if logprobs is not None:
                # a sample without logprobs is unknown (NaN: the learner takes the proximal policy's
                # there), not a reason to drop every other sample's
                logprobs[i, :lr] = math.nan if out.response_logprobs is None else out.response_logprobs[:lr]
            if out.response_versions is not None:
                labels = out.response_versions[:lr]
                token_versions[i, :lr] = labels[0] if labels.count(labels[0]) == lr else labels
            row = token_versions[i, :lr]
            row[row < 0] = self.min_steps[i]

        # One comparison per side gives the whole [B, P+R] mask (no halves to concatenate).
        columns = np.arange(p + r)
        attention = (columns >= p - self.prompt_lengths[:, None]) & (columns < p + self.response_lengths[:, None])
        response_mask *= attention[:, p:]
        token_versions[response_mask == 0] = -1
        if logprobs is not None:
            logprobs[response_mask == 0] = 0.0  # not a product: NaN x 0 is NaN
        rm_scores = np.zeros((b, r), dtype=np.float32)
        scored = np.flatnonzero(self.has_score & (self.response_lengths > 0))
        rm_scores[scored, self.response_lengths[scored] - 1] = self.scores[scored]
        arrays = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": np.concatenate([prompts, responses], axis=1),
            "attention_mask": attention.astype(np.int64),
            "rm_scores": rm_scores,
            "token_versions": token_versions,
        }
        tensors: dict[str, Any] = {name: torch.from_numpy(a) for name, a in arrays.items()}  # shared, not copied
        tensors["position_ids"] = (torch.cumsum(tensors["attention_mask"], dim=1) - 1).clamp(min=0)
        tensors["rollout_log_probs"] = None if logprobs is None else torch.from_numpy(logprobs)
        return tensors


def collate(
    outputs: Sequence[AgentLoopOutput],
    uids: Sequence[str],
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
) -> RolloutBatch:
    """Batch trajectories into a :class:`RolloutBatch` (prompts cut on the left and responses on
    the right if a loop returned more than the widths allow). The per-sample fields are built
    here; the padded ones when first read."""
    import numpy as np
    import torch

    if len(outputs) != len(uids):
        raise ValueError(f"{len(outputs)} outputs for {len(uids)} uids")
    p, r = prompt_length, response_length
    prompt_lengths = np.array([min(len(o.prompt_ids), p) for o in outputs], dtype=np.int64)
    response_lengths = np.array([min(len(o.response_ids), r) for o in outputs], dtype=np.int64)
    has_score = np.array([o.reward_score is not None for o in outputs], dtype=bool)
    scores = np.array([0.0 if o.reward_score is None else float(o.reward_score) for o in outputs], dtype=np.float32)
    min_steps = np.array([_version(o.extra_fields.get("min_global_steps")) for o in outputs], dtype=np.int64)
    max_steps = np.array([_version(o.extra_fields.get("max_global_steps")) for o in outputs], dtype=np.int64)
    group_of: dict[str, int] = {}
    arrays = {
        "scores": scores,
        "has_score": has_score,
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
        "num_turns": np.array([o.num_turns for o in outputs], dtype=np.int64),
        "min_global_steps": min_steps,
        "max_global_steps": max_steps,
        "resume_exhausted": np.array([bool(o.extra_fields.get("resume_exhausted")) for o in outputs], dtype=bool),
        "group_index": np.array([group_of.setdefault(u, len(group_of)) for u in uids], dtype=np.int64),
    }
    rows = _Rows(
        outputs=tuple(outputs),
        prompt_length=p,
        response_length=r,
        pad_token_id=pad_token_id,
        prompt_lengths=prompt_lengths.copy(),
        response_lengths=response_lengths.copy(),
        scores=scores.copy(),
        has_score=has_score.copy(),
        min_steps=min_steps.copy(),
        with_logprobs=any(o.response_logprobs is not None for o in outputs),
    )
    tensors: dict[str, Any] = {name: torch.from_numpy(a) for name, a in arrays.items()}  # shared, not copied
    return RolloutBatch(
        **tensors,
        uid=list(uids),
        extra_fields=[dict(o.extra_fields) for o in outputs],
        metrics=timing_metrics(outputs),
        rows=rows,
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


__all__ = ["RolloutBatch", "PADDED_FIELDS", "collate", "timing_metrics"]
