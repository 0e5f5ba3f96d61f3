"""Trainers by name, and the learner they drive.

``get_trainer_cls(config.trainer.trainer_mode)(config)`` builds one of the registered modes:
``sync``, ``colocate_async``, ``separate_async``. Each gets its client from the fleet
(``get_llm_client``), trains a Hugging Face causal LM with GRPO/PPO (``rollfleet.trainer.learner``;
a simulated learner for the sim engine's benchmarks) and syncs weights with
``manager.update_weights``. The modes are registered by import path and imported on first use.
To add a mode, see :mod:`rollfleet.trainer.registry`.
"""

from rollfleet.trainer.base import Trainer
from rollfleet.trainer.config import SimLearnerConfig, TrainConfig
from rollfleet.trainer.registry import TRAINER_REGISTRY, get_trainer_cls, register_trainer

__all__ = ["Trainer", "TrainConfig", "SimLearnerConfig", "register_trainer", "get_trainer_cls", "TRAINER_REGISTRY"]
