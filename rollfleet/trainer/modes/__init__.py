"""The built-in trainer modes (importing this package registers them)."""

from rollfleet.trainer.modes.colocate_async import ColocateAsyncTrainer
from rollfleet.trainer.modes.separate_async import SeparateAsyncTrainer
from rollfleet.trainer.modes.sync import SyncTrainer

__all__ = ["SyncTrainer", "ColocateAsyncTrainer", "SeparateAsyncTrainer"]
