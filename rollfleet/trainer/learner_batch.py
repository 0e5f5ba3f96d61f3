"""The batches the learner reads: :class:`LearnerBatch` (a rollout batch, checked) and
:class:`PreparedBatch` (device tensors plus advantages and proximal log probs).

Kept apart from :mod:`rollfleet.trainer.learner` so that the layout a batch must have (and the
errors naming a field that breaks it) reads in one place; shapes are in the learner's docstring.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import torch

from rollfleet.errors import InvalidRequest

#: Other names a batch may use for a field (verl and the agent loop's ``RolloutBatch`` say ``uid``).
BATCH_FIELD_ALIASES: dict[str, tuple[str, ...]] = {"uids": ("uid",)}


@dataclass
class LearnerBatch:
    """The fields of a rollout batch the learner reads (see the module docstring for shapes).
    The agent loop's ``RolloutBatch`` (or a dict) is converted with :meth:`from_any`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    uids: Optional[Sequence[Hashable]] = None
    advantages: Optional[torch.Tensor] = None

    @classmethod
    def from_any(cls, batch: Any) -> "LearnerBatch":
        """Read the fields by name from a mapping or from attributes (any dataclass with these
        field names, such as the agent loop's ``RolloutBatch``; see ``BATCH_FIELD_ALIASES``);
        other fields are ignored."""
        if isinstance(batch, cls):
            return batch

        def read(name: str) -> Any:
            for key in (name, *BATCH_FIELD_ALIASES.get(name, ())):
                value = batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)
                if value is not None:
                    return value
            return None

        values = {f.name: read(f.name) for f in fields(cls)}
        for name in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask"):
            if values[name] is None:
                raise InvalidRequest(f"batch.{name}", "present", None)
        if values["scores"] is not None:
            values["scores"] = torch.as_tensor(values["scores"], dtype=torch.float32)
        out = cls(**values)
        out.validate()
        return out

    def validate(self) -> None:
        """Shapes agree and ``input_ids[:, -R:]`` equals ``responses`` on the response mask."""
        b, length = self.input_ids.shape
        r = self.responses.shape[-1]
        for name in ("attention_mask", "position_ids"):
            shape = tuple(getattr(self, name).shape)
            if shape != (b, length):
                raise InvalidRequest(f"batch.{name}", f"shape {(b, length)} like input_ids", shape)
        for name in ("responses", "response_mask", "rollout_log_probs", "advantages"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b, r):
                raise InvalidRequest(f"batch.{name}", f"shape {(b, r)}", tuple(t.shape))
        if r >= length:
            raise InvalidRequest("batch.input_ids", f"length > R={r} (at least one prompt position)", length)
        mask = self.response_mask.bool()
        if not torch.equal(self.input_ids[:, -r:][mask], self.responses[mask]):
            raise InvalidRequest("batch.responses", "equal to input_ids[:, -R:] on response_mask", "mismatch")
        if self.advantages is None and (self.scores is None or self.uids is None):
            raise InvalidRequest("batch.scores", "scores and uids present when advantages are not given", None)
        if self.scores is not None and tuple(self.scores.shape) != (b,):
            raise InvalidRequest("batch.scores", f"shape {(b,)}", tuple(self.scores.shape))
        # one NaN would make its group's advantages, then the loss, NaN: the whole step skipped
        for name, values in (("scores", self.scores), ("advantages", self.advantages)):
            if values is not None and not bool(torch.isfinite(values).all()):
                rows = torch.nonzero(~torch.isfinite(values).reshape(b, -1).all(-1)).flatten().tolist()
                raise InvalidRequest(f"batch.{name}", "finite numbers", f"NaN or infinite in rows {rows[:8]}")


@dataclass
class PreparedBatch:
    """A batch ready for gradient steps: device tensors plus advantages and proximal (and
    reference) log probs, all ``[B, R]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> "PreparedBatch":
        """The rows ``index`` (a slice or a 1-D index tensor)."""
        changes: dict[str, Any] = {}
        for f in fields(self):
            t = getattr(self, f.name)
            changes[f.name] = None if t is None else t[index.to(t.device) if isinstance(index, torch.Tensor) else index]
        return replace(self, **changes)


__all__ = ["LearnerBatch", "PreparedBatch", "BATCH_FIELD_ALIASES"]
