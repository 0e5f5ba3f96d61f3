"""One real vLLM CPU replica, placed through a placement group on a second node of a multi-node
Ray cluster (selected by a node label), serves and takes a weight update."""

from __future__ import annotations

import pytest
from model_support import tiny_state_dict

from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager

pytestmark = [pytest.mark.ray, pytest.mark.cluster, pytest.mark.vllm]


async def test_a_vllm_replica_on_a_labelled_worker_node_serves_and_updates(cluster):
    worker = cluster.add_node(num_cpus=2, num_gpus=0, node_ip_address="127.0.0.1", labels={"pool": "vllm"})
    cluster.wait_for_nodes()
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm",
                "model": "tiny",
                "num_replicas": 1,
                "prompt_length": 32,
                "response_length": 16,
                "max_model_len": 128,
                "placement": {"device": "cpu", "node_labels": {"pool": "vllm"}, "timeout_s": 30},
                "vllm": {"max_num_seqs": 16},
            }
        }
    )
    manager = await LLMServerManager.create(config)
    try:
        (replica,) = await manager.get_replicas()
        assert replica.node_id == worker.node_id and replica.state == "healthy"
        assert replica.address.startswith("http://127.0.0.1:")
        import ray

        free = ray._private.state.available_resources_per_node()[worker.node_id]
        assert free.get("CPU", 0) == 1.0  # the replica's bundle holds one of the node's two CPUs
        client = manager.get_client()
        before = await client.generate(
            "a", prompt_ids=[5, 6, 7, 8], sampling_params={"max_tokens": 8, "temperature": 0}
        )
        assert len(before.token_ids) >= 1 and before.extra_fields["global_steps"] == 0
        result = await manager.update_weights(tiny_state_dict(), 1)
        assert result["failed"] == [] and result["replicas"] == 1
        after = await client.generate("b", prompt_ids=[5, 6, 7, 8], sampling_params={"max_tokens": 8, "temperature": 0})
        assert after.extra_fields["global_steps"] == 1 and after.token_ids == before.token_ids  # same weights
    finally:
        await manager.shutdown()
        cluster.remove_node(worker)
