"""The small simulated training job the trainer tests share."""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.config import RollfleetConfig, load_config
from rollfleet.models.vocab import fit_sim_to_model


def sim_train_config(tmp_path, mode: str, rollout: Optional[dict[str, Any]] = None, **trainer) -> RollfleetConfig:
    """A 3-step ``mode`` job on 2 simulated replicas; ``rollout`` and ``trainer`` override keys."""
    overrides = {
        "rollout.name": "sim",
        "rollout.num_replicas": 2,
        "rollout.n": 2,
        "rollout.prompt_length": 64,
        "rollout.response_length": 12,
        "rollout.max_model_len": 128,
        "rollout.sim.time_scale": 20.0,
        "rollout.sim.mean_response_tokens": 10,
        "agent.num_workers": 1,
        "trainer.trainer_mode": mode,
        "trainer.total_steps": 3,
        "trainer.train_batch_size": 2,
        "trainer.output_dir": str(tmp_path),
        "trainer.run_name": mode,
        "trainer.learner.micro_batch_size": 8,
    }
    overrides.update({f"rollout.{k}": v for k, v in (rollout or {}).items()})
    overrides.update({f"trainer.{k}": v for k, v in trainer.items()})
    return fit_sim_to_model(load_config(None, overrides))
