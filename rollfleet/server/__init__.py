"""One replica: a Ray actor around an engine, with validation, version stamps, health and load."""

from rollfleet.server.actor import ReplicaActor
from rollfleet.server.replica import Replica
from rollfleet.server.validation import validate_prompt, validate_sampling_params

__all__ = ["Replica", "ReplicaActor", "validate_prompt", "validate_sampling_params"]
