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

from rollfleet.config.engines import SGLangEngineConfig, SimEngineConfig, VLLMEngineConfig
from rollfleet.config.fleet import (
    HealthConfig,
    PlacementConfig,
    PrometheusSection,
    RetryConfig,
    RoutingConfig,
    WeightSyncConfig,
)
from rollfleet.config.loading import SECTION_VALIDATORS, load_config, register_section_validator, validate_sections
from rollfleet.config.rollout import RolloutConfig
from rollfleet.config.sections import (
    AgentConfig,
    GatewayConfig,
    HttpAgentConfig,
    MultiTurnConfig,
    RayConfig,
    RollfleetConfig,
    TrainerConfig,
)

__all__ = [
    "SimEngineConfig",
    "VLLMEngineConfig",
    "SGLangEngineConfig",
    "PlacementConfig",
    "RoutingConfig",
    "RetryConfig",
    "HealthConfig",
    "WeightSyncConfig",
    "PrometheusSection",
    "RolloutConfig",
    "RayConfig",
    "HttpAgentConfig",
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
