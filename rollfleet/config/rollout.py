"""The ``rollout`` section: engine, model, replicas, lengths, and the fleet services' sections."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from rollfleet.config.base import _Section
from rollfleet.config.engines import SGLangEngineConfig, SimEngineConfig, VLLMEngineConfig
from rollfleet.config.fleet import (
    HealthConfig,
    PlacementConfig,
    PrometheusSection,
    RetryConfig,
    RoutingConfig,
    WeightSyncConfig,
)

#: Where each built-in engine sets its devices per replica: (section, key) under ``rollout``.
TP_SETTINGS = {
    "vllm": ("vllm", "tensor_parallel_size"),
    "sglang": ("sglang", "tp_size"),
    "sim": ("sim", "tensor_parallel_size"),
}


def tensor_parallel_field(engine: str) -> str:
    """The dotted name of ``engine``'s devices-per-replica setting (for errors that blame it)."""
    section, key = TP_SETTINGS.get(engine, ("engine_args", "tensor_parallel_size"))
    return f"rollout.{section}.{key}"


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
    data_plane_pickle: bool = Field(
        False,
        description="Let the direct data plane carry pickle frames (requests or outputs with values JSON cannot "
        "carry). Unpickling runs code: off, such a request takes the Ray path and such an output is an error.",
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
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
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
    def _one_attached_server(self) -> "RolloutConfig":
        """An SGLang server given by address is one replica: several replicas on it counted its load
        twice, and each one's pause or abort (SGLang's act on the whole server) stopped the others'."""
        if self.name == "sglang" and self.sglang.base_url is not None and self.num_replicas > 1:
            raise ValueError(
                f"rollout.sglang.base_url names one running server: rollout.num_replicas must be 1 with it, "
                f"got {self.num_replicas}"
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
        setting = TP_SETTINGS.get(self.name)
        if setting is None:  # a registered third-party engine
            return int(self.engine_args.get("tensor_parallel_size") or self.engine_args.get("tp_size") or 1)
        section, key = setting
        return int(getattr(getattr(self, section), key))

    @model_validator(mode="after")
    def _lengths(self) -> "RolloutConfig":
        """``max_model_len`` given, or derived: the sim engine's own when only that is given (it was
        ignored), else the lengths' sum. Derived, it follows an assignment made later, not stale.
        The sim engine's is kept equal to it, so a config dumped and loaded again stays valid."""
        sim_given = self.name == "sim" and "max_model_len" in self.sim.model_fields_set
        if self.max_model_len is None or "max_model_len" not in self.model_fields_set:
            derived = self.sim.max_model_len if sim_given else self.prompt_length + self.response_length
            object.__setattr__(self, "max_model_len", derived)
        elif sim_given and self.sim.max_model_len != self.max_model_len:
            raise ValueError(
                f"rollout.sim.max_model_len ({self.sim.max_model_len}) differs from rollout.max_model_len "
                f"({self.max_model_len}): the sim engine's context is rollout.max_model_len; give one of them"
            )
        assert self.max_model_len is not None  # set just above when it was not given
        if self.max_model_len < 2:
            raise ValueError("rollout.max_model_len must be >= 2")
        if self.max_model_len <= self.prompt_length:
            # a prompt of prompt_length tokens leaves no room to generate: every replica refused it
            # mid-run, naming prompt_ids, not the config. (Below prompt_length + response_length is
            # allowed: a multi-turn trajectory's budget is then cut where the context ends.)
            given = "rollout.sim.max_model_len" if sim_given else "rollout.max_model_len"
            raise ValueError(
                f"{given} ({self.max_model_len}) must be > rollout.prompt_length ({self.prompt_length}): "
                "a prompt of that length leaves no token to generate"
            )
        # Kept equal whatever the engine (a plan renames a dumped vllm config's engine to sim),
        # unless this engine is not the sim and the sim section gives its own.
        own = self.name != "sim" and "max_model_len" in self.sim.model_fields_set
        if not own and self.sim.max_model_len != self.max_model_len:
            sim = self.sim.model_copy()  # keeps which fields were given; a copy: the section may be shared
            object.__setattr__(sim, "max_model_len", self.max_model_len)
            object.__setattr__(self, "sim", sim)
        return self
