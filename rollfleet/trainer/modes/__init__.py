"""The built-in trainer modes (registered by import path in :mod:`rollfleet.trainer.registry`)."""

from rollfleet.trainer.modes.colocate_async import ColocateAsyncTrainer
from rollfleet.trainer.modes.separate_async import SeparateAsyncTrainer
from rollfleet.trainer.modes.sync import SyncTrainer

__all__ = ["SyncTrainer", "ColocateAsyncTrainer", "SeparateAsyncTrainer"]
