"""Typed, validated configuration, loadable from YAML.

Keys follow verl's ``actor_rollout_ref.rollout.*`` where verl has one (``name``, ``prompt_length``,
``response_length``, ``max_model_len``, ``full_determinism``, ...). Each component receives only
its own section (the sim engine gets ``SimEngineConfig``, the router ``RoutingConfig``), never the
whole tree. Every field is validated at construction, so a typo or a negative length fails at
start-up with the field named, not in the middle of a rollout.

Names of plug-ins are checked against their registries at construction: ``rollout.name`` against
the engines (:data:`rollfleet.engines.ENGINES`; any registered engine, a third-party one taking
its settings from ``rollout.engine_args``), ``rollout.routing.policy`` against the routing
policies. Those registries hold import paths, so checking a name imports no implementation.

The ``trainer`` section is the exception, checked by :func:`load_config` rather than at
construction: its schema (``rollfleet.trainer.config.TrainConfig``) lives in the trainer layer,
which imports torch (seconds), and a ``RollfleetConfig`` is rebuilt from a dict in every Ray
worker that never trains. So this bottom layer keeps ``trainer`` as an open section and holds a
registry of section validators, by import path: ``load_config`` (every CLI command goes through
it) runs the validator of each section the input gives, before anything starts; a trainer built
in Python parses the section again with ``TrainConfig``. Tools that add top-level sections can
register theirs with :func:`register_section_validator`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from rollfleet.registry import Registry


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SimEngineConfig(_Section):
    """Parameters of the simulated engine.

    Defaults resemble a 7B dense model (Qwen2.5-7B class, bf16) on one H100-80GB under vLLM:
    a decode step of ~7 ms plus ~0.06 ms per running sequence (so ~22 ms at 256 sequences, i.e.
    ~11k output tokens/s), prefill at ~25k tokens/s (0.04 ms per uncached prompt token),
    ~110k tokens of KV cache (0.5 MB per token in bf16 with GQA off, ~55 GB left after weights),
    16-token KV blocks and at most 256 running sequences.
    """

    vocab_size: int = Field(32000, ge=16, description="Token ids are drawn from [0, vocab_size).")
    eos_token_id: int = Field(2, ge=0, description="Token that ends a response with stop_reason 'stop'.")
    max_model_len: int = Field(32768, ge=16, description="Context length: prompt + response tokens.")
    step_base_ms: float = Field(7.0, ge=0, description="Fixed cost of one engine step (ms).")
    step_per_seq_ms: float = Field(0.06, ge=0, description="Decode cost per running sequence per step (ms).")
    prefill_per_token_ms: float = Field(0.04, ge=0, description="Cost per uncached prompt token (ms).")
    kv_capacity_tokens: int = Field(110_000, ge=16, description="KV-cache capacity in tokens.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block (unit of prefix caching).")
    prefix_cache_blocks: int = Field(
        4096, ge=0, description="Bound of the prefix cache (LRU over token blocks); 0 disables it."
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one running batch.")
    mean_response_tokens: float = Field(
        400.0, gt=0, description="Mean of the long-tailed (log-normal) natural response length."
    )
    response_sigma: float = Field(
        1.0, ge=0, description="Sigma of the log-normal response length; larger = longer tail."
    )
    time_scale: float = Field(
        1.0, gt=0, description="Simulated seconds per wall second (60 = a GPU minute in a second)."
    )
    seed: int = Field(0, description="Seed of the engine's deterministic choices.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Devices one simulated replica stands for (what it reserves on a cluster with GPUs)."
    )


class VLLMEngineConfig(_Section):
    """How a replica launches and talks to a vLLM OpenAI server on loopback."""

    dtype: str = Field("auto", description="'auto' picks float32 on CPU and bfloat16 on GPU.")
    enforce_eager: bool = Field(True, description="Skip graph capture: much faster start-up on CPU.")
    kv_cache_space_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    enable_prefix_caching: bool = True
    omp_threads_bind: Optional[str] = Field(
        None, description="VLLM_CPU_OMP_THREADS_BIND; None lets rollfleet pick a core range per replica."
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="Readiness wait before start-up fails.")
    request_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="Extra CLI args for the server.")
    extra_env: dict[str, str] = Field(default_factory=dict)


class SGLangEngineConfig(_Section):
    """How a replica launches or reaches an SGLang server."""

    base_url: Optional[str] = Field(
        None, description="An already running SGLang server; when None, rollfleet launches one."
    )
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    startup_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    vocab_size: Optional[int] = Field(
        None,
        ge=1,
        description="Vocabulary size for input validation. SGLang's HTTP API does not report it; when "
        "None it is read from the model's config.json (local folder or Hugging Face cache).",
    )


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


class RoutingConfig(_Section):
    """The routing policy and the balancer's knobs (no built-in policy has knobs of its own)."""

    policy: str = Field(
        "least_tokens",
        description="A registered routing policy: least_inflight | least_tokens | power_of_two | rendezvous, or "
        "one added with rollfleet.routing.register_policy (checked at construction).",
    )
    max_cache_size: int = Field(10_000, ge=1, description="Sticky sessions remembered per client (LRU).")
    sticky: bool = Field(True, description="Keep all turns of a request_id on one replica.")
    sticky_overload_factor: float = Field(
        1.5, ge=1.0, description="A sticky replica gives way when its load exceeds factor x mean load ..."
    )
    sticky_overload_slack: int = Field(
        8, ge=0, description="... and also exceeds mean + slack in-flight requests (both must hold)."
    )
    load_refresh_interval_s: float = Field(
        1.0,
        gt=0,
        description="How stale a client's view of other clients' load may get. Changes of membership, health "
        "and weight versions reach clients at once (they watch the controller); loads are polled at "
        "health.probe_interval_s, so a shorter value buys little.",
    )

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
    auto_restart: bool = Field(True, description="Restart dead replicas and sync them before serving.")


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


class RolloutConfig(_Section):
    """The fleet: engine, model, replicas, lengths, routing, retries (verl's ``rollout`` section)."""

    name: str = Field(
        "sim",
        description="Engine of every replica: sim | vllm | sglang, or one added with "
        "rollfleet.engines.register_engine (checked at construction).",
    )
    model: str = Field("tiny", description="Built-in model name or a path to a Hugging Face folder.")
    num_replicas: int = Field(2, ge=0)
    prompt_length: int = Field(512, ge=1, description="Prompt padding width and prompt budget.")
    response_length: int = Field(512, ge=1, description="Response budget of one trajectory.")
    max_model_len: Optional[int] = Field(
        None, ge=2, description="Context length; defaults to prompt_length + response_length."
    )
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, description="Samples per prompt (GRPO group size).")
    calculate_log_probs: bool = True
    full_determinism: bool = Field(False, description="Deterministic routing (rendezvous) and seeds.")
    seed: int = 0
    data_plane: Literal["direct", "ray"] = Field(
        "direct",
        description="How generate requests reach a replica: 'direct' (one multiplexed TCP connection per "
        "client process and replica, JSON frames) or 'ray' (one Ray actor call per request, as verl does). "
        "Control operations always go through Ray.",
    )
    data_plane_ports: Optional[tuple[int, int]] = Field(
        None,
        description="Inclusive port range [low, high] the replicas' data planes listen on (open it between "
        "nodes, like Ray's worker ports); None: any free port. A client that cannot reach a data plane "
        "sends its requests through Ray instead.",
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    sim: SimEngineConfig = Field(default_factory=SimEngineConfig)
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig)
    sglang: SGLangEngineConfig = Field(default_factory=SGLangEngineConfig)
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of an engine added with register_engine (its from_config reads and validates "
        "them; 'tensor_parallel_size' or 'tp_size' sets the devices per replica). The built-in engines take "
        "theirs from rollout.sim / rollout.vllm / rollout.sglang, so this must stay empty for them.",
    )
    prometheus: PrometheusSection = Field(default_factory=PrometheusSection)

    @field_validator("name")
    @classmethod
    def _registered_engine(cls, name: str) -> str:
        from rollfleet.engines import ENGINES  # names only: no engine is imported

        return ENGINES.check_name(name)

    @model_validator(mode="after")
    def _engine_args(self) -> "RolloutConfig":
        from rollfleet.engines import BUILTIN_ENGINES

        if self.engine_args and self.name in BUILTIN_ENGINES:
            raise ValueError(
                f"rollout.engine_args is for engines added with register_engine; '{self.name}' takes its "
                f"settings from rollout.{self.name}"
            )
        return self

    @model_validator(mode="after")
    def _ports(self) -> "RolloutConfig":
        if self.data_plane_ports is not None:
            low, high = self.data_plane_ports
            if not 1 <= low <= high <= 65535:
                raise ValueError(
                    f"data_plane_ports must satisfy 1 <= low <= high <= 65535, got {self.data_plane_ports}"
                )
        return self

    @property
    def tensor_parallel_size(self) -> int:
        """Devices per replica: the engine's own tensor-parallel setting."""
        sizes = {
            "vllm": self.vllm.tensor_parallel_size,
            "sglang": self.sglang.tp_size,
            "sim": self.sim.tensor_parallel_size,
        }
        if self.name not in sizes:  # a registered third-party engine
            return int(self.engine_args.get("tensor_parallel_size") or self.engine_args.get("tp_size") or 1)
        return sizes[self.name]

    @model_validator(mode="after")
    def _lengths(self) -> "RolloutConfig":
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.prompt_length + self.response_length)
        assert self.max_model_len is not None  # set just above when it was not given
        if self.max_model_len < 2:
            raise ValueError("rollout.max_model_len must be >= 2")
        return self


class RayConfig(_Section):
    """Where Ray runs. No address: an embedded local cluster is started."""

    address: Optional[str] = Field(
        None,
        description="An existing cluster ('auto', 'host:port' or 'ray://host:10001'); None starts an embedded "
        "one on loopback.",
    )
    num_cpus: Optional[int] = Field(None, ge=1, description="Logical CPUs of the embedded cluster.")
    num_gpus: Optional[int] = Field(None, ge=0, description="GPUs of the embedded cluster; None: what Ray detects.")
    ship_package: bool = Field(
        True,
        description="When joining a cluster, ship this rollfleet package to every node (runtime_env py_modules) "
        "so worker nodes need no install of their own.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict, description="Extra Ray runtime_env for the job (env_vars, pip, working_dir, ...)."
    )
    namespace: str = "rollfleet"
    include_dashboard: bool = False


class MultiTurnConfig(_Section):
    """Multi-turn tool calling (verl's ``rollout.multi_turn``)."""

    max_assistant_turns: Optional[int] = Field(None, ge=1, description="None: bounded by the budget only.")
    max_user_turns: Optional[int] = Field(None, ge=1)
    max_parallel_calls: int = Field(4, ge=1, description="Tool calls run concurrently per turn.")
    max_tool_response_length: int = Field(256, ge=1, description="Characters kept of a tool's output.")
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    tool_timeout_s: float = Field(30.0, gt=0)
    format: str = Field("hermes", description="Tool-call parser: see rollfleet.agent_loop.tool_parser.")
    tool_config_path: Optional[str] = Field(
        None,
        description="YAML listing tools by import path (a BaseTool subclass or a plain function); "
        "see rollfleet.agent_loop.tools.load_tools.",
    )


class AgentConfig(_Section):
    """Agent-loop workers (verl's ``rollout.agent``)."""

    num_workers: int = Field(2, ge=1, description="AgentLoopWorker actors; each holds one client.")
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: Optional[str] = Field(None, description="YAML naming extra loops by import path.")
    max_concurrent_trajectories: int = Field(256, ge=1, description="Per worker.")
    default_reward: Optional[str] = Field(
        None,
        description="Reward function (rollfleet.reward registry) for samples whose reward spec names none; "
        "None: such samples get no score.",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)


class GatewayConfig(_Section):
    """The OpenAI-compatible HTTP front door."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port.")
    served_model_name: Optional[str] = Field(None, description="Model name in /v1/models; defaults to rollout.model.")
    admin_token: Optional[str] = Field(None, description="Bearer token for /admin; admin routes are off without one.")
    request_timeout_s: float = Field(600.0, gt=0)
    prometheus_file: Optional[str] = Field(None, description="Write a Prometheus scrape config here at start-up.")
    tokenizer: Optional[str] = Field(
        None, description="Tokenizer folder (or built-in model name); defaults to rollout.model's folder."
    )
    prometheus_port: Optional[int] = Field(
        None, ge=1, le=65535, description="After writing prometheus_file, ask the Prometheus on this port to reload."
    )
    prometheus_scrape_interval: str = Field(
        "10s", description="scrape_interval of the jobs written to prometheus_file."
    )
    stream_chunk_tokens: int = Field(
        8,
        ge=1,
        description="Tokens per SSE chunk when a finished result is streamed (the fleet is not token-streaming).",
    )
    max_n: int = Field(16, ge=1, description="Largest 'n' (choices per prompt) one request may ask for.")
    status_poll_interval_s: float = Field(
        2.0, gt=0, description="How often fleet health, versions and replica stats are polled for /metrics."
    )
    access_log: bool = Field(False, description="uvicorn access log (one line per request: costs throughput).")
    no_server_wait_s: float = Field(
        10.0,
        ge=0,
        description="How long a request waits for a routable replica before the gateway answers 503 "
        "(an HTTP caller should hear back sooner than a trainer's rollout waits).",
    )


class TrainerConfig(_Section):
    """Trainer selection (``trainer_mode``) and the knobs shared by all modes.

    An open section here: its keys are those of ``rollfleet.trainer.config.TrainConfig`` (the
    trainer layer), checked by :func:`load_config` through the ``trainer`` section validator, not
    at construction (see the module docstring for why).
    """

    trainer_mode: str = Field("sync", description="Registered trainer name: sync | colocate_async | separate_async.")
    model_config = ConfigDict(extra="allow", validate_assignment=True)


class RollfleetConfig(BaseModel):
    """The whole tree. Unknown top-level sections are kept (for tools built on top)."""

    model_config = ConfigDict(extra="allow")

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)


SectionValidator = Callable[[Mapping[str, Any]], None]

#: Top-level section -> a validator of its content (raises ``pydantic.ValidationError`` or
#: ``ValueError``), registered by import path so that this module imports no higher layer.
SECTION_VALIDATORS: Registry[SectionValidator] = Registry(
    "config section validator",
    callable_only=True,
    builtins={"trainer": "rollfleet.trainer.config:validate_trainer_section"},
)


def register_section_validator(section: str, validator: Union[SectionValidator, str]) -> None:
    """Have :func:`load_config` check top-level ``section`` with ``validator`` (or its import path)."""
    SECTION_VALIDATORS.register(section, validator)


def validate_sections(config: RollfleetConfig) -> RollfleetConfig:
    """Run the validator of every section ``config`` was given (a section left to its defaults is
    skipped, and its validator never imported). Errors come back as one ``ValidationError`` whose
    locations start with the section (``trainer.learnr``)."""
    given = set(config.model_fields_set) | set(config.model_extra or {})
    for section in SECTION_VALIDATORS.names():
        if section not in given:
            continue
        value = getattr(config, section)
        data = value.model_dump() if isinstance(value, BaseModel) else value
        try:
            SECTION_VALIDATORS.get(section)(data)
        except ValidationError as exc:
            raise _under(section, exc) from None
        except ValueError as exc:
            raise ValidationError.from_exception_data(
                "RollfleetConfig",
                [InitErrorDetails(type="value_error", loc=(section,), input=data, ctx={"error": exc})],
            ) from None
    return config


def _under(section: str, exc: ValidationError) -> ValidationError:
    """``exc`` with every error location prefixed by ``section``."""
    details = []
    for e in exc.errors():
        detail = InitErrorDetails(type=e["type"], loc=(section, *e["loc"]), input=e["input"])
        if "ctx" in e:
            detail["ctx"] = e["ctx"]
        details.append(detail)
    try:
        return ValidationError.from_exception_data("RollfleetConfig", details)
    except (KeyError, TypeError, ValueError):  # an error type pydantic cannot rebuild: keep the original
        return exc


def load_config(path: str | Path | None = None, overrides: Optional[dict[str, Any]] = None) -> RollfleetConfig:
    """Load a YAML file (or defaults) and apply nested ``overrides`` (dotted keys allowed).

    Validated in full: the tree at construction, then every given section that has a validator
    registered (``trainer``), so a typo anywhere fails here, before Ray or any engine starts."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    for key, value in (overrides or {}).items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return validate_sections(RollfleetConfig.model_validate(data))


__all__ = [
    "SimEngineConfig",
    "VLLMEngineConfig",
    "SGLangEngineConfig",
    "PlacementConfig",
    "RoutingConfig",
    "RetryConfig",
    "HealthConfig",
    "PrometheusSection",
    "RolloutConfig",
    "RayConfig",
    "MultiTurnConfig",
    "AgentConfig",
    "GatewayConfig",
    "TrainerConfig",
    "RollfleetConfig",
    "SECTION_VALIDATORS",
    "register_section_validator",
    "validate_sections",
    "load_config",
]
