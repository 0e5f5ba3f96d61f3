"""The controller keeps a reference to the last weights, never the bytes: its memory does not grow
with the size of the model or the number of syncs (100 syncs of a 100 MB state dict)."""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest

from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MB = 1 << 20


async def test_controller_memory_does_not_grow_with_syncs_of_a_100_mb_model(ray_session):
    config = RollfleetConfig.model_validate(
        {"rollout": {"name": "sim", "num_replicas": 2, "max_model_len": 1024, "sim": {"vocab_size": 500}}}
    )
    manager = await LLMServerManager.create(config)
    try:
        pid = await manager.controller.__ray_call__.remote(lambda self: os.getpid())
        controller = psutil.Process(pid)
        start = (await manager.status()).current_version
        rss = []
        for step in range(1, 101):
            weights = {"model.embed_tokens.weight": np.full(25 * MB // 4, step, dtype=np.float32)}
            assert weights["model.embed_tokens.weight"].nbytes == 25 * MB
            weights["lm_head.weight"] = np.full(75 * MB // 4, -step, dtype=np.float32)  # 100 MB in all
            result = await manager.update_weights(weights, start + step)
            assert result["failed"] == []
            rss.append(controller.memory_info().rss)
        # one copy of the weights would be 100 MB; 100 syncs kept whole would be 10 GB
        assert max(rss) - rss[0] < 50 * MB, [r // MB for r in rss[::10]]
        checksums = await manager.weights_checksums()
        assert len(set(checksums.values())) == 1  # both replicas hold the last version's weights
        assert (await manager.status()).current_version == start + 100
    finally:
        await manager.shutdown()
