"""A real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, what Ray's own
tests use): a head and two worker nodes with 4 fake GPUs each, every node on 127.0.0.1. Ray assigns
GPU ids per node and sets ``CUDA_VISIBLE_DEVICES`` as it does on real GPUs; ``remove_node`` is a
real node death (its raylet and every worker process on it are killed).

The session's single-node Ray is stopped for this module and started again afterwards.
"""

from __future__ import annotations

import os

import pytest
from ray_support import start_session_ray

GPUS_PER_NODE = 4
CPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    had_session = ray.is_initialized()
    if had_session:
        ray.shutdown()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    node_args = dict(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE, node_ip_address="127.0.0.1")
    c = Cluster(initialize_head=True, head_node_args=dict(node_args, include_dashboard=False))
    c.add_node(**node_args)
    c.add_node(**node_args)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="rollfleet-cluster-tests", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if had_session:
            start_session_ray()


def alive_node_ids() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]
