"""A learner that only takes time: for the sim engine's benchmarks and capacity planning.

Training time = (tokens x ``seconds_per_token`` + the sum of squared sample lengths x
``seconds_per_token_squared``) / ``resource_share`` + ``seconds_per_step``: the weights' FLOPs are
linear in the batch's tokens (prompts included: they go forward and backward too), attention's
quadratic in each sample's length; ``resource_share`` is the share of the simulated accelerators
the learner holds (1.0 when rollout and training take turns on the same resources, 0.5 when
``separate_async`` splits them in two). The "weights" it pushes are a step counter, which the sim
engine folds into its tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from rollfleet.trainer.checkpoint import (
    DEFAULT_KEEP_LAST,
    FORMAT_VERSION,
    META_FILE,
    TRAINER_STATE_FILE,
    commit_checkpoint,
    resolve_checkpoint,
)
from rollfleet.trainer.config import SimLearnerConfig


def _sample_lengths(batch: Any) -> Any:
    """Each sample's real tokens (prompt + response), as float64: from the per-sample lengths
    where the batch has them (a ``RolloutBatch``: its padded tensors are then never built), else
    from the attention mask (any verl-style batch); None for a batch with neither."""
    prompt, response = getattr(batch, "prompt_lengths", None), getattr(batch, "response_lengths", None)
    if prompt is not None and response is not None:
        return (prompt + response).double()
    if hasattr(batch, "attention_mask"):
        return batch.attention_mask.sum(dim=1).double()
    return None


class SimulatedLearner:
    def __init__(self, config: SimLearnerConfig) -> None:
        self.config = config
        self.global_step = 0
        self.trained_tokens = 0

    def update(self, batch: Any) -> dict[str, float]:
        seconds, metrics = self.step(batch)
        time.sleep(seconds)
        return metrics

    def step(self, batch: Any) -> tuple[float, dict[str, float]]:
        """Count a step on ``batch`` and say how long it takes, without taking it (a caller on a
        virtual clock sleeps there instead of in wall time)."""
        cfg = self.config
        lengths = _sample_lengths(batch)
        if lengths is not None:
            tokens, squares = int(lengths.sum().item()), float((lengths * lengths).sum().item())
        else:
            tokens, squares = 0, 0.0
        compute = tokens * cfg.seconds_per_token + squares * cfg.seconds_per_token_squared
        seconds = compute / cfg.resource_share + cfg.seconds_per_step
        self.global_step += 1
        self.trained_tokens += tokens
        return seconds, {"actor/global_step": float(self.global_step), "actor/train_s": seconds}

    def state_dict_for_inference(self) -> dict[str, Any]:
        return {"sim_step": self.global_step}

    def save(
        self, root: str | Path, trainer_state: Optional[dict[str, Any]] = None, keep_last: Optional[int] = None
    ) -> Path:
        """Checkpoint the step counter, the tokens trained and the caller's JSON ``trainer_state``
        under ``root/step_<global_step>``, as atomically and pruned as the torch learner's (see
        :mod:`rollfleet.trainer.checkpoint`): a plan saving every few steps keeps the last few."""
        state_json = json.dumps(trainer_state or {})  # fails before anything is written
        meta = {"format_version": FORMAT_VERSION, "step": self.global_step, "trained_tokens": self.trained_tokens}

        def fill(folder: Path) -> None:
            (folder / TRAINER_STATE_FILE).write_text(state_json)
            (folder / META_FILE).write_text(json.dumps(meta))

        return commit_checkpoint(root, self.global_step, fill, keep_last or DEFAULT_KEEP_LAST)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore the step counter and the tokens trained; returns the saved ``trainer_state``."""
        folder = resolve_checkpoint(path)
        meta = json.loads((folder / META_FILE).read_text())
        self.global_step = int(meta["step"])
        self.trained_tokens = int(meta.get("trained_tokens", 0))
        return json.loads((folder / TRAINER_STATE_FILE).read_text())


__all__ = ["SimulatedLearner"]
