"""The cluster configs in configs/ load, validate, and fit the cluster they describe (2 nodes x 8
GPUs): every replica's tensor-parallel group on one node, and the learner's device where the mode
puts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollfleet.config import load_config
from rollfleet.manager.placement import NodeInfo, choose_node, device_bundle
from rollfleet.trainer.config import TrainConfig

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def two_nodes_of_8_gpus() -> list[NodeInfo]:
    res = {"GPU": 8.0, "CPU": 64.0}
    return [NodeInfo(f"node-{i}", f"10.0.0.{i}", True, res, dict(res), {}) for i in range(2)]


def plan(config) -> list[NodeInfo]:
    rollout = config.rollout
    bundle = device_bundle(rollout.placement.device, rollout.placement)
    tp = rollout.tensor_parallel_size
    nodes, hosted = two_nodes_of_8_gpus(), {}
    for _ in range(rollout.num_replicas):
        chosen = choose_node(nodes, bundle, tp, rollout.placement.strategy, rollout.placement.node_labels, hosted)
        assert chosen is not None, "the config does not fit 2 x 8 GPUs"
        hosted[chosen.node_id] = hosted.get(chosen.node_id, 0) + 1
        nodes = [
            NodeInfo(n.node_id, n.ip, True, n.total, {k: v - bundle.get(k, 0) * tp for k, v in n.free.items()}, {})
            if n.node_id == chosen.node_id
            else n
            for n in nodes
        ]
    return nodes


@pytest.mark.parametrize(
    "name, mode, colocate, learner_gpus_left",
    [
        ("cluster_separate.yaml", "separate_async", None, 2),
        ("cluster_colocated.yaml", "colocate_async", True, 0),
    ],
)
def test_cluster_config_fits_two_nodes_of_eight_gpus(name, mode, colocate, learner_gpus_left):
    config = load_config(CONFIGS / name)
    train = TrainConfig.model_validate(config.trainer.model_dump())
    assert train.trainer_mode == mode and train.colocate == colocate
    assert config.rollout.tensor_parallel_size == 2 and config.ray.address == "auto"
    left = plan(config)
    assert sum(n.free["GPU"] for n in left) == learner_gpus_left  # separate: room for its learner
