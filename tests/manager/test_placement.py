"""Placement decisions without Ray: node choice per strategy, label selectors, capacity, the
engine's launch arguments for its devices and address."""

from __future__ import annotations

import pytest

from rollfleet.config import PlacementConfig, RolloutConfig
from rollfleet.engines.vllm import VLLMEngine
from rollfleet.errors import InsufficientResources
from rollfleet.manager.placement import (
    NodeInfo,
    Placer,
    choose_node,
    describe_cluster,
    device_bundle,
    label_matches,
    replicas_that_fit,
)

pytestmark = pytest.mark.unit

GPU = {"GPU": 1.0, "CPU": 1.0}


def node(name: str, gpus: float = 4, free_gpus: float | None = None, labels=None, alive=True) -> NodeInfo:
    free = gpus if free_gpus is None else free_gpus
    return NodeInfo(name, "10.0.0." + name[-1], alive, {"GPU": gpus, "CPU": 8}, {"GPU": free, "CPU": 8}, labels or {})


def place(nodes, n, strategy, tp=2, selector=None):
    """Place n replicas one after the other, taking their resources, as the Placer does."""
    nodes = list(nodes)
    hosted: dict[str, int] = {}
    out = []
    for _ in range(n):
        chosen = choose_node(nodes, GPU, tp, strategy, selector or {}, hosted)
        out.append(chosen.node_id if chosen else None)
        if chosen is None:
            continue
        hosted[chosen.node_id] = hosted.get(chosen.node_id, 0) + 1
        i = next(i for i, x in enumerate(nodes) if x.node_id == chosen.node_id)
        free = dict(chosen.free, GPU=chosen.free["GPU"] - tp, CPU=chosen.free["CPU"] - tp)
        nodes[i] = NodeInfo(chosen.node_id, chosen.ip, True, chosen.total, free, chosen.labels)
    return out


def test_pack_fills_a_node_first_spread_balances_strict_spread_refuses_a_second():
    nodes = [node("n1"), node("n2"), node("n3")]
    assert place(nodes, 4, "PACK") == ["n1", "n1", "n2", "n2"]
    assert place(nodes, 4, "SPREAD") == ["n1", "n2", "n3", "n1"]
    assert place(nodes, 4, "STRICT_SPREAD") == ["n1", "n2", "n3", None]
    assert place(nodes, 7, "PACK")[-1] is None  # 12 GPUs hold 6 replicas of tp=2


def test_pack_prefers_the_tightest_fit_and_skips_dead_or_full_nodes():
    nodes = [node("n1", free_gpus=4), node("n2", free_gpus=2), node("n3", alive=False), node("n4", free_gpus=1)]
    assert place(nodes, 1, "PACK") == ["n2"]
    assert place(nodes, 1, "SPREAD") == ["n1"]
    assert choose_node([node("n1", free_gpus=1)], GPU, 2, "PACK", {}, {}) is None  # tp=2 never splits


def test_label_selector_rules():
    labels = {"pool": "rollout", "zone": "a"}
    assert label_matches(labels, {"pool": "rollout"})
    assert not label_matches(labels, {"pool": "train"})
    assert label_matches(labels, {"pool": "!train", "zone": "in(a, b)"})
    assert not label_matches(labels, {"zone": "!in(a,b)"})
    assert not label_matches({}, {"pool": "rollout"}) and label_matches({}, {"pool": "!rollout"})
    nodes = [node("n1", labels={"pool": "train"}), node("n2", labels={"pool": "rollout"})]
    assert place(nodes, 3, "PACK", selector={"pool": "rollout"}) == ["n2", "n2", None]


def test_capacity_counts_and_the_description_in_errors():
    n = node("n1", gpus=8)
    assert replicas_that_fit(n, GPU, 2, free=False) == 4
    assert replicas_that_fit(n, {"GPU": 1.0, "CPU": 3.0}, 2, free=False) == 1  # 8 CPUs bound it
    text = describe_cluster([node("n1"), node("n2", gpus=8), node("n3", alive=False)], {})
    assert text == "2 live nodes with 12 GPU, 16 CPU (at most 8 GPU on one node)"
    assert describe_cluster([node("n1")], {"pool": "x"}) == "no live node matching {'pool': 'x'}"


def test_bundles_per_device_kind_and_custom_resources():
    cfg = PlacementConfig(cpus_per_device=2, resources={"rollout_slot": 1})
    assert device_bundle("gpu", cfg) == {"CPU": 2.0, "GPU": 1.0, "rollout_slot": 1}
    assert device_bundle("cpu", cfg) == {"CPU": 2.0, "rollout_slot": 1}
    with pytest.raises(ValueError, match="rollout.placement.resources"):
        PlacementConfig(resources={"GPU": 1})


def test_devices_per_replica_follow_the_engines_tensor_parallel_size():
    assert RolloutConfig(name="vllm", vllm={"tensor_parallel_size": 4}).tensor_parallel_size == 4
    assert RolloutConfig(name="sglang", sglang={"tp_size": 2}).tensor_parallel_size == 2
    assert RolloutConfig(name="sim", sim={"tensor_parallel_size": 8}).tensor_parallel_size == 8


def test_vllm_listens_on_its_node_and_sees_exactly_its_devices():
    eng = VLLMEngine("tiny", max_model_len=64, device="cuda", listen="tcp")
    eng.assign("10.1.2.3", ["4", "5"])
    eng.port = 8123
    cmd = eng._command()
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3" and cmd[cmd.index("--tensor-parallel-size") + 1] == "1"
    env = eng._env()
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["VLLM_HOST_IP"] == "10.1.2.3"
    private = VLLMEngine("tiny", max_model_len=64, device="cuda")  # listen: unix, the default
    private.assign("10.1.2.3", ["4"])
    private.socket_path = "/tmp/x/server.sock"
    cmd = private._command()
    assert cmd[cmd.index("--uds") + 1] == "/tmp/x/server.sock" and "--host" not in cmd and "--port" not in cmd
    cpu = VLLMEngine("tiny", max_model_len=64, device="cpu", num_replicas=2, replica_index=1)
    cpu.assign("127.0.0.1", None)
    env = cpu._env()
    assert "VLLM_CPU_OMP_THREADS_BIND" in env and env.get("CUDA_VISIBLE_DEVICES") == __import__("os").environ.get(
        "CUDA_VISIBLE_DEVICES"
    )


async def test_a_reservation_cancelled_while_it_waits_for_devices_removes_its_group(monkeypatch):
    """A restart waiting for devices is cancelled by a removal or a shutdown: its placement group,
    not yet known to the placer, stayed pending, and took the devices when they freed up."""
    import asyncio
    import importlib

    from rollfleet.manager.placement import Placer

    ray_pg = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is the function)

    created: list[object] = []
    removed: list[object] = []

    class Pending:
        def ready(self) -> "asyncio.Future[None]":
            return asyncio.get_running_loop().create_future()  # Ray cannot place it yet

    def placement_group(bundles, **kwargs):
        created.append(Pending())
        return created[-1]

    monkeypatch.setattr(ray_pg, "placement_group", placement_group)
    monkeypatch.setattr(ray_pg, "remove_placement_group", removed.append)
    placer = Placer(PlacementConfig(device="gpu", timeout_s=30.0), 1, "vllm")

    async def nodes(with_free: bool = True) -> list[NodeInfo]:
        return [node("n1", gpus=8)]

    placer.nodes = nodes  # type: ignore[method-assign]
    reserving = asyncio.ensure_future(placer.reserve("replica-3"))
    while not created:
        await asyncio.sleep(0.01)
    reserving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reserving
    assert removed == created and placer.placements == {}


async def test_a_reservation_right_after_a_release_waits_for_rays_view_of_the_freed_devices(monkeypatch):
    """Ray shows a removed group's devices as free 0.02-0.1 s after the removal: adding a replica
    right after removing one (or launching right after a shutdown) failed at once with "no live
    node has room now". The placer looks again for a moment; with no room at all it still says so."""
    import asyncio
    import importlib

    from rollfleet.errors import InsufficientResources
    from rollfleet.manager import placement as placement_module
    from rollfleet.manager.placement import Placer

    ray_pg = importlib.import_module("ray.util.placement_group")

    class Placed:
        def ready(self) -> "asyncio.Future[None]":
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    monkeypatch.setattr(ray_pg, "placement_group", lambda bundles, **kwargs: Placed())
    looks: list[int] = []

    async def lagging(with_free: bool = True) -> list[NodeInfo]:
        looks.append(1)  # the freed GPU shows from the third look on
        return [node("n1", gpus=1, free_gpus=1 if len(looks) >= 3 else 0)]

    placer = Placer(PlacementConfig(device="gpu"), 1, "vllm")
    placer.nodes = lagging  # type: ignore[method-assign]
    placed = await placer.reserve("replica-1")
    assert placed is not None and placed.node_id == "n1" and len(looks) == 3
    monkeypatch.setattr(placement_module, "FREE_VIEW_LAG_S", 0.3)

    async def full(with_free: bool = True) -> list[NodeInfo]:
        return [node("n1", gpus=1, free_gpus=0)]

    placer = Placer(PlacementConfig(device="gpu"), 1, "vllm")
    placer.nodes = full  # type: ignore[method-assign]
    with pytest.raises(InsufficientResources, match="no live node has room now"):
        await placer.reserve("replica-2")


def placer_over(nodes: list[NodeInfo], tp: int, engine: str = "vllm", **placement) -> Placer:
    """A placer that sees ``nodes`` as Ray's node table (no Ray)."""
    placer = Placer(PlacementConfig(device="gpu", **placement), tp, engine)

    async def listed(with_free: bool = True) -> list[NodeInfo]:
        return nodes

    placer.nodes = listed  # type: ignore[method-assign]
    return placer


@pytest.mark.parametrize(
    "tp, engine, placement, field, limit, seen",
    [
        # 16 GPUs in all, 8 on a node: no number of replicas fits a 16-device replica
        (16, "vllm", {}, "rollout.vllm.tensor_parallel_size", "16 GPU on one node", "at most 8 GPU on one live node"),
        (16, "sglang", {}, "rollout.sglang.tp_size", "16 GPU on one node", "at most 8 GPU on one live node"),
        (2, "vllm", {"cpus_per_device": 6}, "rollout.placement.cpus_per_device", "12 CPU on one node", "at most 8 CPU"),
        # a custom resource no node has: named, and counted in the cluster's description
        (1, "vllm", {"resources": {"rollout_slot": 1}}, "rollout.placement.resources.rollout_slot", "1 rollout_slot on one node", "0 rollout_slot"),
    ],
)  # fmt: skip
async def test_a_replica_no_node_can_hold_is_blamed_on_the_setting_that_sizes_it(
    tp, engine, placement, field, limit, seen
):
    """It used to name ``rollout.num_replicas`` and say nothing of a custom resource."""
    placer = placer_over([node("n1", gpus=8), node("n2", gpus=8)], tp, engine, **placement)
    with pytest.raises(InsufficientResources) as err:
        await placer.check_capacity(1, "rollout.num_replicas")
    assert err.value.field == field and limit in str(err.value) and seen in str(err.value)


async def test_on_cpu_devices_the_cpus_per_device_are_blamed_and_a_selector_matching_nothing_is_said():
    nodes = [node("n1", gpus=0), node("n2", gpus=0)]  # 8 CPUs each
    placer = placer_over(nodes, 1, cpus_per_device=16)
    placer.config = placer.config.model_copy(update={"device": "cpu"})
    with pytest.raises(InsufficientResources) as err:
        await placer.check_capacity(1, "rollout.num_replicas")
    assert err.value.field == "rollout.placement.cpus_per_device" and "at most 8 CPU" in str(err.value)
    placer = placer_over([node("n1", gpus=8)], 1, node_labels={"pool": "rollout"})
    with pytest.raises(InsufficientResources) as err:
        await placer.check_capacity(1, "rollout.num_replicas")
    assert err.value.field == "rollout.num_replicas" and "no live node matching {'pool': 'rollout'}" in str(err.value)


async def test_too_many_replicas_that_each_fit_are_blamed_on_the_count():
    placer = placer_over([node("n1", gpus=8), node("n2", gpus=8)], 4)
    await placer.check_capacity(4, "rollout.num_replicas")
    with pytest.raises(InsufficientResources) as err:
        await placer.check_capacity(5, "rollout.num_replicas")
    assert err.value.field == "rollout.num_replicas" and "room for 4 such replicas" in str(err.value)
    with pytest.raises(InsufficientResources) as err:  # growing: what the caller asked for, and the total
        await placer.check_capacity(5, "add_replicas(n)", adding=1)
    assert "asks for 1 more replica (5 in all) x 4 GPU" in str(err.value), str(err.value)
