"""A short real run: GRPO in separate_async mode on a vLLM CPU replica with the tiny model."""

from __future__ import annotations

import json

import pytest

from rollfleet.config import load_config
from rollfleet.trainer import get_trainer_cls

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


async def test_short_real_run_completes_and_syncs_weights_to_vllm(ray_session, tmp_path):
    cfg = load_config(
        "configs/demo.yaml",
        {
            "rollout.num_replicas": 1,
            "rollout.n": 4,
            "agent.num_workers": 1,
            "trainer.total_steps": 3,
            "trainer.train_batch_size": 4,
            "trainer.save_freq": 0,
            "trainer.output_dir": str(tmp_path),
            "trainer.run_name": "vllm-short",
        },
    )
    trainer = get_trainer_cls("separate_async")(cfg)
    try:
        await trainer.init()
        summary = await trainer.fit()
        status = await trainer.manager.status()
    finally:
        await trainer.close()
    assert summary["steps"] == 3 and summary["syncs"] == 3
    assert status.current_version == 3
    assert all(r.weight_version == 3 for r in status.replicas.values())
    rows = [json.loads(line) for line in (tmp_path / "vllm-short" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["response_length/mean"] > 0 for r in rows)
    assert all(r["staleness/max"] <= cfg.trainer.model_dump()["max_off_policy_steps"] for r in rows)
    assert (tmp_path / "vllm-short" / "checkpoints" / "latest").exists()
