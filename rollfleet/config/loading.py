"""Loading a YAML file into a validated tree, and the registry of section validators."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails

from rollfleet.config.sections import RollfleetConfig
from rollfleet.registry import Registry

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


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice in one mapping: YAML keeps the last,
    so a second ``rollout:`` block would drop every setting of the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: merged by the parent
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # unhashable: the parent refuses it, as safe_load does
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: Optional[dict[str, Any]] = None) -> RollfleetConfig:
    """Load a YAML file (or defaults) and apply nested ``overrides`` (dotted keys allowed).

    Validated in full: the tree at construction, then every given section that has a validator
    registered (``trainer``), so a typo anywhere fails here, before Ray or any engine starts."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            try:
                data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"{path} is not YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must map section names to settings, got a {type(data).__name__}")
        # A section left empty (``gateway:`` with its lines commented out) is one with no settings,
        # as an override into it already read it.
        data = {key: {} if value is None else value for key, value in data.items()}
    for key, value in (overrides or {}).items():
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1], 1):
            if node.get(part) is None:  # missing, or an empty section (``rollout:`` alone)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(
                    f"override {key}: {'.'.join(parts[:depth])} is a {type(node).__name__} ({node!r}), not a section"
                )
        node[parts[-1]] = value
    return validate_sections(RollfleetConfig.model_validate(data))
