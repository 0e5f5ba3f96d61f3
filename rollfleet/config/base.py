"""The base of every config section: unknown keys and bad assignments fail at once."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __setattr__(self, name: str, value: Any) -> None:
        """An assignment a validator refuses leaves the section as it was. Why: pydantic applies
        the value before the section's own validators run, and keeps it when one of them refuses
        it (``rollout.max_model_len = 300`` against a sim section's 4,096 raised, and stayed 300)."""
        before, given = dict(self.__dict__), set(self.__pydantic_fields_set__)
        try:
            super().__setattr__(name, value)
        except ValidationError:
            object.__setattr__(self, "__dict__", before)
            object.__setattr__(self, "__pydantic_fields_set__", given)
            raise
