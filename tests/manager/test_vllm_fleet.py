"""The fleet on the real engine: 2 vLLM CPU replicas with the built-in tiny model.

One fleet for the whole module (each vLLM start-up costs ~40 s on 2 cores). The test that kills a
vLLM process runs last.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from model_support import tiny_state_dict

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.errors import InvalidRequest
from rollfleet.manager import LLMServerManager
from rollfleet.records import FleetStatus

try:
    from tests.engines.vllm_probe import StreamingProbe, wait_for
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from engines.vllm_probe import StreamingProbe, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

#: More positions than the tiny model's own 4,096 (``--hf-overrides``; its rotary embedding has no
#: learned positions): room for a generation long enough that a weight update sent while it runs
#: reaches it mid-way, however loaded the machine.
MAX_MODEL_LEN = 12288
#: 16 of these run 16-80 s here; the update is sent 3-27 s in (the servers' API loops answer the
#: probes late on shared cores). A try the update missed is followed by one twice, then three times
#: as long (12,000: the positions allow it), under a timeout of its own.
LONG = 4000
#: How an update names a replica it fenced for answering too late, not wrongly: the fan-out's own
#: limit, our HTTP client's timeout, or the prober declaring it dead for probes that timed out
#: (not a crash, and not an error vLLM answered, even one that says "timed out").
STARVED = re.compile(
    r"ControlTimeout\(|timed out talking to|abandoned: dead \(probe failed \(\d+x\): (Get)?TimeoutError"
)


@pytest.fixture(scope="module")
async def fleet(ray_session):
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm",
                "model": "tiny",
                "num_replicas": 2,
                "prompt_length": 512,
                "response_length": 256,
                "max_model_len": MAX_MODEL_LEN,
                "routing": {"policy": "least_tokens", "load_refresh_interval_s": 0.2},
                "health": {
                    "probe_interval_s": 0.5,
                    # A CI host running two CPU engines through 16 long generations has starved a
                    # replica actor past 5 s three times in a row (both replicas restarted, and the
                    # exact-budget test ran out of time): these tests are not about detecting hangs.
                    "probe_timeout_s": 15.0,
                    "failures_to_dead": 3,
                    # A replica declared dead under a starved CPU comes back, as it would for a
                    # user: each test waits for a serving fleet first (serving()) and shows why not.
                    "auto_restart": True,
                },
                "retry": {"max_attempts": 40, "initial_backoff_s": 0.05, "max_backoff_s": 0.5},
                "vllm": {
                    "max_num_seqs": 128,
                    "extra_args": ["--hf-overrides", f'{{"max_position_embeddings": {MAX_MODEL_LEN}}}'],
                },
            }
        }
    )
    manager = await LLMServerManager.create(config)
    yield manager
    await manager.shutdown()


async def serving(fleet: LLMServerManager, timeout_s: float = 240.0) -> None:
    """Wait until every replica is healthy on the fleet's version and reports nothing in flight;
    else fail with the fleet's recent transitions (what a previous test left behind shows here, not
    as a vague timeout). A new client starts from the replicas' last reports: one taken while the
    previous test's requests ran counts them as others' load until the next poll, and steers its
    first placements (seen: a GRPO group split over both servers, and longest-group-first's probes
    all sent to one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await fleet.status()
        states = {rid: (r.state, r.weight_version, r.inflight or 0) for rid, r in status.replicas.items()}
        if all(state == "healthy" and v == status.current_version and not n for state, v, n in states.values()):
            return
        if time.monotonic() > deadline:
            recent = transitions(status, sep="\n  ")
            raise AssertionError(f"fleet not serving (v{status.current_version}): {states}\n  {recent}")
        await asyncio.sleep(0.5)


def transitions(status: FleetStatus, sep: str = "; ") -> str:
    """The fleet's recent replica transitions, for a failure message."""
    return sep.join(f"{e.replica_id}: {e.from_state} -> {e.to} ({e.detail})" for e in status.events)


async def vllm_metric(address: str, name: str) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{address}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def computed_prompt_tokens(addresses: list[str]) -> float:
    """Prompt tokens the servers computed so far, by vLLM's own counters: prefix-cache queries
    minus hits."""
    queries = [await vllm_metric(a, "vllm:prefix_cache_queries_total") for a in addresses]
    hits = [await vllm_metric(a, "vllm:prefix_cache_hits_total") for a in addresses]
    return sum(queries) - sum(hits)


async def kv_block_size(address: str) -> int:
    """The server's KV block size, from vllm:cache_config_info."""
    async with httpx.AsyncClient(timeout=10) as http:
        info = (await http.get(f"{address}/metrics")).text
    found = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', info)
    assert found, "vLLM reports its KV block size in vllm:cache_config_info"
    return int(found.group(1))


async def test_serves_200_concurrent_requests(fleet):
    await serving(fleet)
    client = fleet.get_client()
    outs = await asyncio.gather(
        *(
            client.generate(
                f"c{i}", prompt_ids=[10 + i % 50, 20, 30, 40], sampling_params={"max_tokens": 16, "temperature": 1.0}
            )
            for i in range(200)
        )
    )
    assert all(1 <= len(o.token_ids) <= 16 and len(o.log_probs) == len(o.token_ids) for o in outs)
    assert all(o.stop_reason in ("stop", "length") for o in outs)
    assert {o.extra_fields["replica_id"] for o in outs} == {"replica-0", "replica-1"}
    assert client.balancer.get_total_inflight() == 0


async def test_vllm_servers_and_data_planes_listen_on_loopback_only(fleet):
    """On this loopback cluster every listener of a replica's process tree (its data plane, its
    metrics exporter and vLLM's own engine processes) is bound to 127.0.0.1; the vLLM API server
    listens on a Unix socket."""
    await serving(fleet)
    import ipaddress

    import psutil

    stats = await fleet.replica_stats()
    found = []
    for s in stats.values():
        actor = psutil.Process(s["pid"])
        for proc in [actor] + actor.children(recursive=True):
            found += [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    replicas = await fleet.get_replicas()
    ports = {a.port for a in found}
    assert all(int(r.address.rsplit(":", 1)[1]) in ports for r in replicas)  # the metrics exporters were seen
    assert all(r.server_socket.endswith("server.sock") for r in replicas)  # vLLM itself: a private socket
    wide = [a for a in found if not ipaddress.ip_address(a.ip.removeprefix("::ffff:")).is_loopback]
    assert not wide, wide


async def test_multi_turn_sessions_stick_and_hit_vllm_prefix_cache(fleet):
    await serving(fleet)
    client = fleet.get_client()
    addresses = {r.replica_id: r.address for r in await fleet.get_replicas()}
    hits_before = {rid: await vllm_metric(a, "vllm:prefix_cache_hits_total") for rid, a in addresses.items()}

    async def session(s: int) -> set[str]:
        prompt = [(s * 13 + j) % 500 + 5 for j in range(96)]
        seen = set()
        for _turn in range(3):
            out = await client.generate(
                f"sess-{s}", prompt_ids=prompt, sampling_params={"max_tokens": 24, "temperature": 0.8}
            )
            seen.add(out.extra_fields["replica_id"])
            prompt = prompt + out.token_ids + [7, 8, 9, 10]
        client.finish_session(f"sess-{s}")
        return seen

    seen = await asyncio.gather(*(session(s) for s in range(16)))
    assert all(len(s) == 1 for s in seen)
    hits_after = {rid: await vllm_metric(a, "vllm:prefix_cache_hits_total") for rid, a in addresses.items()}
    gained = sum(hits_after[r] - hits_before[r] for r in addresses)
    assert gained >= 16 * 64  # later turns reuse their session's earlier turns (>= 64 tokens per session)


async def test_grpo_siblings_prefill_their_prompt_once_under_prefix_affinity(fleet):
    """The routing benchmark's GRPO finding, checked on vLLM: a group's 8 samples sent at once under
    prefix_affinity share one server, whose prefix cache serves the prompt to the siblings (vLLM
    caches a block when it is scheduled, so siblings in the same step share it); least_tokens
    spreads them, and each server computes the prompt. Computed prompt tokens are vLLM's own
    counters: prefix-cache queries minus hits."""
    await serving(fleet)
    addresses = [r.address for r in await fleet.get_replicas()]

    prompt_len, groups = 1024, 4

    async def rollout(policy: str, salt: int) -> float:
        routing = fleet.config.routing.model_copy(update={"policy": policy, "seed": 0})
        client = fleet.get_client(config=fleet.config.model_copy(update={"routing": routing}))
        prompts = [[(salt * 7919 + g * 131 + j * 17) % 900 + 5 for j in range(prompt_len)] for g in range(groups)]
        before = await computed_prompt_tokens(addresses)
        outs = await asyncio.gather(
            *(
                client.generate(f"{policy}-g{g}-{i}", prompt_ids=prompts[g], sampling_params={"max_tokens": 8})
                for g in range(groups)
                for i in range(8)
            )
        )
        per_group = [{o.extra_fields["replica_id"] for o in outs[g * 8 : (g + 1) * 8]} for g in range(groups)]
        print(policy, "replicas per group:", [sorted(r) for r in per_group])
        return (await computed_prompt_tokens(addresses)) - before

    affinity = await rollout("prefix_affinity", 1)
    # A new client starts from the replicas' last load reports; one taken while the first rollout
    # ran counts its requests as others' load for up to a probe interval, and least_tokens then
    # sends whole groups to the other server (seen in CI). Let two probes pass first.
    await asyncio.sleep(2 * fleet.config.health.probe_interval_s + 0.5)
    spread = await rollout("least_tokens", 2)
    block = await kv_block_size(addresses[0])
    # A sibling whose whole prompt is cached still computes its last block (vLLM computes at least one
    # token): one prefill per group and a block per other sibling when together (measured: exactly
    # that, 1,920 tokens per group of 8 x 1,024 with vLLM CPU's 128-token blocks), one prefill per
    # server and a block per other sibling when spread over both servers.
    together = groups * (prompt_len + 7 * block)
    apart = groups * (2 * prompt_len + 6 * block)
    print(
        f"computed prompt tokens: prefix_affinity {affinity:.0f} (together: {together}), least_tokens {spread:.0f} (apart: {apart})"
    )
    assert affinity <= 1.1 * together, (affinity, together)
    assert spread >= 0.95 * apart, (spread, apart)
    assert affinity < 0.75 * spread


async def test_longest_group_first_on_vllm_serves_every_sample_and_prefills_each_group_prompt_once(fleet):
    """Longest-group-first dispatch (late binding: probes first, siblings held in the client) on
    real engines: every sample gets exactly its length, nothing is left in flight or held, and the
    siblings stay with their group's cached prompt. vLLM's own counters (less the last block it
    computes again for a fully cached prompt) show one prefill per replica a group went to: the
    siblings on it hit its prefix cache. And few groups went to both servers, as spreading sends
    every group (2 prefills per group on 2 servers): a replica left with none of its groups waiting
    steals one at the drain, a timing-dependent share: 1.06-1.25 prefills per group over three runs
    here, since a replica probes a new prompt before it steals and each test starts from quiet
    load reports (:func:`serving`); 1.06-1.31 over nine before, and 1.56 once in CI. Issue 15's
    target, in ``benchmarks/routing_vllm.py``'s 48 groups, is at most 1.25."""
    await serving(fleet)
    addresses = [r.address for r in await fleet.get_replicas()]
    prompt_len, groups, samples = 384, 16, 8

    routing = fleet.config.routing.model_copy(
        update={
            "policy": "prefix_affinity",
            "seed": 0,
            "max_inflight_per_replica": 6,
            "dispatch_order": "longest_group_first",
        }
    )
    client = fleet.get_client(config=fleet.config.model_copy(update={"routing": routing}))
    prompts = [[(g * 523 + j * 31) % 900 + 7 for j in range(prompt_len)] for g in range(groups)]
    lengths = [[8 + (g * 29 + i * 3) % 48 for i in range(samples)] for g in range(groups)]
    before = await computed_prompt_tokens(addresses)
    try:
        outs = await asyncio.gather(
            *(
                client.generate(
                    f"longest-g{g}-{i}",
                    prompt_ids=prompts[g],
                    sampling_params={"max_tokens": lengths[g][i], "ignore_eos": True},
                )
                for g in range(groups)
                for i in range(samples)
            )
        )
        assert [len(o.token_ids) for o in outs] == [n for row in lengths for n in row]
        assert client.balancer.get_total_inflight() == 0
        assert client._gate is not None and client._gate.waiting == 0
    finally:
        await client.close()
    block = await kv_block_size(addresses[0])
    prefills = ((await computed_prompt_tokens(addresses) - before) / groups - samples * block) / (prompt_len - block)
    homes = len({(i // samples, o.extra_fields["replica_id"]) for i, o in enumerate(outs)}) / groups
    print(f"longest group first on vLLM: each group prompt prefilled {prefills:.2f} times, on {homes:.2f} replicas")
    assert prefills <= homes + 0.1, (prefills, homes)
    assert homes <= 1.75, homes


async def test_greedy_outputs_change_only_with_a_weight_update(fleet):
    await serving(fleet)
    client = fleet.get_client()
    prompt = [11, 12, 13, 14, 15, 16]
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    a = await client.generate("g1", prompt_ids=prompt, sampling_params=params)
    b = await client.generate("g2", prompt_ids=prompt, sampling_params=params)
    assert a.token_ids == b.token_ids
    version = (await fleet.status()).current_version + 1
    state = tiny_state_dict()
    import torch

    gen = torch.Generator().manual_seed(version)
    state = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) if "embed" in k or "lm_head" in k else v
        for k, v in state.items()
    }
    before = await fleet.weights_checksums()
    result = await fleet.update_weights(state, version)
    assert result["failed"] == [] and set(result["modes"].values()) == {"keep"}
    # every replica's vLLM reports the same digest of its weights (/weight_checker), a new one
    after = await fleet.weights_checksums()
    assert len(set(after.values())) == 1 and result["checksum"] in after.values()
    assert set(after.values()) != set(before.values())
    c = await client.generate("g3", prompt_ids=prompt, sampling_params=params)
    assert c.token_ids != a.token_ids
    assert c.extra_fields["global_steps"] == version


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_weight_update_mid_generation_keeps_the_exact_budget(fleet, mode):
    """abort: the interrupted generations are resumed; keep: they go on with their KV cache on the new
    weights, never resubmitted, and every token names the weights that sampled it."""
    await serving(fleet)
    client = fleet.get_client(FullyAsyncLLMServerClient)
    state = tiny_state_dict()
    # A try where the generations ended before the update reached them (LONG tokens: tens of
    # seconds) proves nothing, and is tried again with fresh requests, twice as long (a CI host once
    # finished all 16 before the update reached them, twice); so does one in which a replica was
    # declared dead and restarted, or fenced by the update for answering too late (a starved CPU
    # can do both; its requests were then resumed, as they should be, and its server has a new
    # socket). A replica fenced for any other reason fails the test, with the reason. The test
    # fails if no try is conclusive; each try prints when the update went out and returned against
    # when the generations ended.
    inconclusive: list[str] = []  # why each try proved nothing
    for attempt, budget in enumerate((LONG, 2 * LONG, 3 * LONG)):
        await serving(fleet)
        replicas = await fleet.get_replicas()
        restarts = {rid: r.restarts for rid, r in (await fleet.status()).replicas.items()}
        tasks = [
            asyncio.ensure_future(
                client.generate(
                    f"long-{attempt}-{i}",
                    prompt_ids=[21, 22, 23 + i],
                    sampling_params={"max_tokens": budget, "ignore_eos": True, "temperature": 1.0},
                )
            )
            for i in range(16)
        ]
        started = time.monotonic()
        ended: list[float] = []
        for t in tasks:
            t.add_done_callback(lambda _, e=ended, s=started: e.append(time.monotonic() - s))
        # Evidence, not a sleep: the 16 are in the client's in-flight table, then a streaming probe
        # sent to each replica's vLLM afterwards has streamed tokens (those replicas are generating).
        await wait_for(lambda: client.balancer.get_total_inflight() == 16, "16 requests in flight")
        async with StreamingProbe.to(replicas[0]) as p0, StreamingProbe.to(replicas[1]) as p1:
            await p0.wait_tokens(64)
            await p1.wait_tokens(64)
        if any(t.done() for t in tasks):
            inconclusive.append(f"try {attempt}: generations ended before the update was sent")
            await asyncio.gather(*tasks)
            continue
        version = (await fleet.status()).current_version + 1
        sent = time.monotonic() - started
        result = await fleet.update_weights(state, version, mode)
        returned = time.monotonic() - started
        if result["fenced"] and all(STARVED.search(reason) for reason in result["fenced"].values()):
            # A replica too starved to answer in time was fenced (restarted) by the update: the
            # same inconclusive case as one the prober declared dead; its requests are resumed.
            inconclusive.append(f"try {attempt}: the update fenced a starved replica: {result['fenced']}")
            await asyncio.gather(*tasks)
            continue
        assert result["failed"] == [] and set(result["modes"].values()) == {mode}, (
            result,
            transitions(await fleet.status()),
        )
        outs = await asyncio.gather(*tasks)
        steps = {k: round(result[k], 2) for k in ("stage_s", "commit_s", "verify_s", "pause_s")}
        print(f"try {attempt} ({budget} tokens): update sent at {sent:.1f} s, returned at {returned:.1f} s "
              f"({steps}); generations ended at {min(ended):.1f}-{max(ended):.1f} s")  # fmt: skip
        seen = [
            (o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"], o.extra_fields["num_resumes"])
            for o in outs
        ]
        for out in outs:
            assert len(out.token_ids) == budget and len(out.log_probs) == budget  # the budget is exact
            assert out.stop_reason == "length"
        status = await fleet.status()
        restarted = {rid: r.restarts for rid, r in status.replicas.items()} != restarts
        if restarted or any(r.state in ("dead", "restarting", "pending") for r in status.replicas.values()):
            inconclusive.append(f"try {attempt}: a replica was declared dead meanwhile: {transitions(status)}")
            continue
        if mode == "keep":
            assert all(o.extra_fields["num_resumes"] == 0 for o in outs), seen  # nothing was interrupted
            spanned = [o for o in outs if o.extra_fields["min_global_steps"] < o.extra_fields["max_global_steps"]]
            if len(spanned) < 12:
                inconclusive.append(f"try {attempt}: the update reached only {len(spanned)} generations: {seen}")
                continue
            for o in spanned:  # vLLM's own per-token versions: old weights first, then the new ones
                tv = o.token_versions
                assert tv is not None and len(tv) == budget and tv == sorted(tv), seen
                assert set(tv) == {version - 1, version}, set(tv or [])
            return
        # The update landed mid-generation: the outputs were resumed and finished on the new weights;
        # those that had tokens before the abort carry both versions (one aborted before its first
        # token, on a loaded machine, has only the new version's).
        resumed = [o for o in outs if o.extra_fields["num_resumes"] >= 1]
        assert all(
            o.extra_fields["max_global_steps"] == version
            and o.extra_fields["min_global_steps"] in (version - 1, version)
            for o in resumed
        ), seen
        spanned = [o for o in resumed if o.extra_fields["min_global_steps"] < version]
        if len(spanned) < 8:
            inconclusive.append(f"try {attempt}: the update reached only {len(spanned)} generations mid-way: {seen}")
            continue
        return
    raise AssertionError("no try was conclusive:\n" + "\n".join(inconclusive))


async def test_bad_input_is_rejected_and_replicas_keep_serving(fleet):
    await serving(fleet)
    client = fleet.get_client()
    vocab = (await fleet.get_replicas())[0]
    with pytest.raises(InvalidRequest) as err:
        await client.generate("too-long", prompt_ids=[5] * (MAX_MODEL_LEN + 10), sampling_params={"max_tokens": 4})
    assert err.value.field == "prompt_ids"
    with pytest.raises(InvalidRequest) as err:
        await client.generate("oov", prompt_ids=[5, 10**7], sampling_params={"max_tokens": 4})
    assert err.value.field == "prompt_ids[1]"
    outs = await asyncio.gather(
        *(client.generate(f"ok{i}", prompt_ids=[5, 6, 7], sampling_params={"max_tokens": 4}) for i in range(8))
    )
    assert all(o.token_ids for o in outs)
    assert vocab.state == "healthy", vocab


async def test_killed_vllm_process_is_reported_unavailable_quickly(fleet):
    await serving(fleet)
    import os
    import signal

    stats = await fleet.replica_stats()
    pid = int(stats["replica-1"].get("vllm_pid", 0))
    assert pid, stats["replica-1"]
    os.killpg(pid, signal.SIGKILL)
    started = time.monotonic()

    async def reported():
        return (await fleet.status()).replicas["replica-1"].state in ("suspect", "dead")

    while not await reported():
        assert time.monotonic() - started < 15, "a killed vLLM must be reported within seconds, not hang"
        await asyncio.sleep(0.2)
    client = fleet.get_client()
    outs = await asyncio.gather(
        *(client.generate(f"k{i}", prompt_ids=[5, 6, 7], sampling_params={"max_tokens": 4}) for i in range(10))
    )
    assert {o.extra_fields["replica_id"] for o in outs} == {"replica-0"}
