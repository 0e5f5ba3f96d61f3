"""The fleet's services: placement, routing, retries, health checks, weight sync, Prometheus discovery."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from rollfleet.config.base import _Section


class PlacementConfig(_Section):
    """Where replicas run on the Ray cluster (see :mod:`rollfleet.manager.placement`).

    Each replica is one placement group with one bundle per device of its tensor-parallel group,
    all on one node; across replicas ``strategy`` decides how they share nodes. The bundle of a GPU
    device is ``{"GPU": 1, "CPU": cpus_per_device, **resources}``, of a CPU device
    ``{"CPU": cpus_per_device, **resources}``.
    """

    device: Literal["auto", "gpu", "cpu", "none"] = Field(
        "auto",
        description="What a replica reserves per device. auto: 'gpu' when the cluster has GPUs, else 'cpu' for "
        "real engines and 'none' for the sim engine (it uses no device); none: no placement group at all.",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Across replicas: PACK fills a node before the next, SPREAD balances replicas over nodes, "
        "STRICT_SPREAD puts at most one replica on a node.",
    )
    cpus_per_device: float = Field(
        1.0, gt=0, description="CPUs reserved with each device (for a CPU device: the device itself)."
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray label selector every bundle must match, e.g. {'pool': 'rollout'} or "
        "{'ray.io/accelerator-type': 'H100'}; values may be 'x', '!x', 'in(x,y)' or '!in(x,y)'.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources added to every bundle, e.g. {'rollout_slot': 1}."
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for Ray to place one replica before it fails (or stays pending)."
    )
    pending_retry_s: float = Field(
        5.0, gt=0, description="How often a replica waiting for free devices (state 'pending') tries again."
    )
    colocate: bool = Field(
        False,
        description="The learner shares the replicas' bundles (verl's hybrid engine); set by the colocated "
        "trainer modes, see trainer.colocate.",
    )
    colocate_fraction: float = Field(
        0.5, gt=0, lt=1, description="Share of each colocated device the learner reserves; replicas take the rest."
    )

    @model_validator(mode="after")
    def _resources(self) -> "PlacementConfig":
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU") or amount <= 0:
                raise ValueError(
                    f"rollout.placement.resources['{name}'] must be a custom resource with an amount > 0 "
                    "(CPU and GPU come from device and cpus_per_device)"
                )
        return self


class PrefixAffinityConfig(_Section):
    """Knobs of the ``prefix_affinity`` policy (see :mod:`rollfleet.routing.policies.prefix_affinity`)."""

    load_factor: float = Field(
        1.25, ge=1.0, description="A prompt's home keeps its requests while its in-flight count is at most "
        "load_factor x the fleet's mean + slack ..."
    )  # fmt: skip
    slack: float = Field(
        16, ge=0, description="... (slack: room for a whole GRPO group on an idle fleet; at least the group size n)."
    )
    max_homes: int = Field(65536, ge=1, description="Prompts whose home a client remembers (LRU).")


class RoutingConfig(_Section):
    """The routing policy, the balancer's knobs, and a section per policy with knobs of its own
    (named after the policy: ``prefix_affinity``)."""

    policy: str = Field(
        "prefix_affinity",
        description="A registered routing policy: prefix_affinity (default: requests with one prompt share a "
        "replica within a load bound, least tokens in flight otherwise) | least_tokens | least_inflight | "
        "power_of_two | rendezvous, or one added with rollfleet.routing.register_policy (checked at "
        "construction). benchmarks/routing_quality.py compares them.",
    )
    seed: Optional[int] = Field(
        None,
        description="Seed of the client's random choices (the policy's tie-breaks, power_of_two's two picks, the "
        "retry backoff's jitter), for runs that must repeat exactly (rollfleet.plan); None: a fresh seed per "
        "client. full_determinism overrides it.",
    )
    max_cache_size: int = Field(10_000, ge=1, description="Sticky sessions remembered per client (LRU).")
    sticky: bool = Field(True, description="Keep all turns of a request_id on one replica.")
    sticky_overload_factor: float = Field(
        1.5, ge=1.0, description="A sticky replica gives way when its load exceeds factor x mean load ..."
    )
    sticky_overload_slack: int = Field(
        8, ge=0, description="... and also exceeds mean + slack in-flight requests (both must hold) ..."
    )
    sticky_spill_kv_usage: float = Field(
        0.9,
        gt=0,
        le=1,
        description="... and is saturated: its engine has requests waiting, or KV cache usage at or above "
        "this fraction (a replica that runs all it has keeps its sessions and their prefix cache).",
    )
    max_inflight_per_replica: Optional[int] = Field(
        None,
        ge=1,
        description="Late binding: a request that starts a new placement (not a session's next turn, not a "
        "sibling of a prompt prefix_affinity has placed) waits in the client until some replica has fewer "
        "requests in flight than this; it then goes to the replica that freed up. The engine's batch slots "
        "(max_num_seqs) plus the sequences a replica finishes during one dispatch round trip (a result back "
        "to the client, the next request into the engine): fewer, and its engine runs short of sequences "
        "(2 over 8 slots did on vLLM CPU replicas sharing 2 cores; 8 did not). None: every request is sent at "
        "once and engines queue them.",
    )
    dispatch_order: Literal["fifo", "longest_group_first"] = Field(
        "fifo",
        description="Which request late binding lets go next: fifo (arrival; session turns and siblings of a "
        "placed prompt never wait) | longest_group_first (one sample of each prompt first, then the siblings "
        "of the prompts whose first sample ran longest, so short samples are left for the end; siblings "
        "wait too). Needs max_inflight_per_replica.",
    )
    dispatch_lookahead: float = Field(
        1.0,
        gt=0,
        description="longest_group_first: new prompts are probed while the siblings held behind probed ones "
        "would keep the fleet's dispatch slots busy for less than this many times the longest probe seen "
        "(counted in waves: the longest probe's run time over the mean). More ranks more groups against each "
        "other; less keeps a held group's prompt in the prefix cache (benchmarks/routing_quality.py compares "
        "0.5, 1 and 2).",
    )
    prefix_affinity: PrefixAffinityConfig = Field(
        default_factory=PrefixAffinityConfig, description="Used when policy is prefix_affinity."
    )
    load_refresh_interval_s: float = Field(
        1.0,
        gt=0,
        description="How stale a client's view of other clients' load may get. Changes of membership, health "
        "and weight versions reach clients at once (they watch the controller); loads are polled at "
        "health.probe_interval_s, so a shorter value buys little.",
    )

    def policy_options(self) -> dict[str, Any]:
        """The chosen policy's own section, as its constructor's keywords ({} if it has none)."""
        section = getattr(self, self.policy, None)
        return section.model_dump() if isinstance(section, _Section) else {}

    @model_validator(mode="after")
    def _ordered_dispatch_needs_a_limit(self) -> "RoutingConfig":
        if self.dispatch_order != "fifo" and self.max_inflight_per_replica is None:
            raise ValueError(
                f"routing.dispatch_order={self.dispatch_order!r} orders the requests late binding holds back; "
                "set routing.max_inflight_per_replica (about the engines' max_num_seqs) or use 'fifo'"
            )
        return self

    @field_validator("policy")
    @classmethod
    def _registered_policy(cls, policy: str) -> str:
        from rollfleet.routing.policies import POLICIES  # names only: no policy is imported

        return POLICIES.check_name(policy)


class RetryConfig(_Section):
    """Bounded retry with exponential backoff, for replica failures and abort-resume."""

    max_attempts: int = Field(16, ge=1, description="Attempts per request (failures plus resumes).")
    initial_backoff_s: float = Field(0.01, ge=0, description="First wait before a retry.")
    max_backoff_s: float = Field(1.0, ge=0, description="Cap of the exponential backoff.")
    multiplier: float = Field(2.0, ge=1.0)
    jitter: float = Field(0.1, ge=0, le=1, description="Random +- fraction added to each wait.")
    request_timeout_s: Optional[float] = Field(
        None, gt=0, description="Wall limit of one attempt; None waits as long as the replica works."
    )
    no_server_wait_s: float = Field(
        300.0,
        ge=0,
        description="How long a request waits for a routable replica (all restarting/syncing) "
        "before failing; these waits do not count as attempts.",
    )


class HealthConfig(_Section):
    """Health probing of replicas (healthy -> suspect -> dead -> restarting -> syncing -> healthy)."""

    probe_interval_s: float = Field(1.0, gt=0)
    probe_timeout_s: float = Field(
        5.0, gt=0, description="A probe slower than this counts as failed (generous: a busy CPU engine answers slowly)."
    )
    failures_to_dead: int = Field(3, ge=1, description="Consecutive failed probes before 'dead'.")
    busy_grace_s: float = Field(
        30.0,
        ge=0,
        description="How long an engine that answers neither its load nor its health in time still counts as busy "
        "(starved of CPU while it generates) rather than hung; its probes fail after that.",
    )
    auto_restart: bool = Field(True, description="Restart dead replicas and sync them before serving.")
    restart_backoff_s: float = Field(
        2.0, gt=0, description="Wait after a failed restart before the next try; doubles each time."
    )
    max_restart_backoff_s: float = Field(60.0, gt=0, description="Cap of the wait between restart tries.")
    max_restart_attempts: Optional[int] = Field(
        None,
        ge=1,
        description="Tries to bring one dead replica back before it stays dead (status shows why); None: forever.",
    )
    start_timeout_s: float = Field(
        1800.0, gt=0, description="Wall limit of starting one replica and loading the current weights into it."
    )
    control_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Per-replica limit of a control call (pause, resume, sleep, wake_up, profile, abort, weight "
        "check): a replica slower than this is fenced (marked dead, restarted) and the call completes on the others.",
    )


class PrometheusSection(_Section):
    """Scrape config the fleet controller writes and refreshes (verl's ``rollout.prometheus``)."""

    enable: bool = Field(False, description="Write (and refresh on membership changes) a Prometheus scrape config.")
    file: Optional[str] = Field(None, description="Where the scrape config is written (merged into an existing one).")
    port: Optional[int] = Field(
        None, ge=1, le=65535, description="Prometheus to ask for a reload (POST /-/reload); None: write only."
    )
    host: str = Field("127.0.0.1", description="Host of the Prometheus asked for a reload.")
    scrape_interval: str = Field("10s", description="scrape_interval of the jobs written to file.")

    @model_validator(mode="after")
    def _file_when_enabled(self) -> "PrometheusSection":
        if self.enable and not self.file:
            raise ValueError("rollout.prometheus.enable=True requires rollout.prometheus.file")
        return self


class WeightSyncConfig(_Section):
    """How new weights reach the fleet (``rollout.weight_sync``; see :mod:`rollfleet.manager.weight_updates`).

    Every update has two phases: *stage* (the weights travel to every replica's node while the
    fleet keeps generating) and *commit* (a short stop in which each engine loads what it staged).
    ``mode`` decides what a commit does to the requests in flight.
    """

    mode: Literal["abort", "keep", "rolling"] = Field(
        "keep",
        description="abort: every replica aborts its in-flight requests (they come back with their partial tokens "
        "and clients resume them on the new weights), loads, resumes. keep: in-flight requests are frozen with their "
        "KV cache and continue on the new weights (no resubmission, no re-prefill); an engine that cannot keep "
        "falls back to abort. rolling: replicas commit in waves of max_unavailable of the fleet, each with keep "
        "where the engine can.",
    )
    max_unavailable: float = Field(
        0.5, gt=0, le=1, description="rolling: the fraction of the fleet committing at once (at least one replica)."
    )
    stage_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Per-replica limit of staging one update (the weights reach its node): a replica slower than "
        "this is fenced and the update goes on without it.",
    )
    commit_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Per-replica limit of committing staged weights (pause, load, resume): a replica slower than this "
        "is fenced; the others never wait for it, each pauses only for its own commit.",
    )
    stage_dir: Optional[str] = Field(
        None,
        description="Node-local folder where engines that load from files stage a state dict (written once per node "
        "and version); None: /dev/shm/rollfleet-weights (memory, no disk) where it exists, else the temp dir.",
    )
    stage_key: Optional[str] = Field(
        None,
        description="Subfolder shared by one fleet's replicas, so that replicas on one node share one staged copy; "
        "None: LLMServerManager gives each fleet its own.",
    )
