"""The small simulated training job the trainer tests share."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
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


class InstantAgents:
    """Agent loops whose trajectories end at once (one token each): a rollouter far faster than
    its learner, for tests that drive the rollouter and the group buffer by hand."""

    def expand(self, batch: list[dict], n: int) -> list[dict]:
        return [{**batch[0], "uid": f"u{batch[0]['task_index']}", "k": k} for k in range(n)]

    async def generate_sequences_single(self, sample: dict) -> Any:
        await asyncio.sleep(0)
        return SimpleNamespace(
            extra_fields={}, metrics=SimpleNamespace(num_resumes=0), response_mask=[1], response_ids=[1]
        )
