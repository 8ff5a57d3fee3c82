"""Reading a configuration file: YAML into a validated config model.

Apart from the models (:mod:`rolloutlog.controller.config`) so that the domain, which
takes its rules from the models, never imports a file format or reads a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from .config import ConfigError, describe_validation_error


def load_yaml(path: Path, model: type[BaseModel]) -> BaseModel:
    """Load and validate a YAML file into ``model``; errors name the offending field."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"configuration {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
            "save it as UTF-8"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"configuration {path} is not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"configuration {path} must be a mapping, got {type(raw).__name__}")
    # YAML's true/false are not numbers: `steps: true` must not run one step.
    problems = _booleans_as_numbers(raw, model)
    if problems:
        raise ConfigError("\n".join([f"invalid configuration in {path}:", *problems]))
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, str(path))) from exc


def _allows_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    return any(_allows_bool(a) for a in get_args(annotation))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _booleans_as_numbers(
    raw: dict[str, Any], model: type[BaseModel], prefix: str = ""
) -> list[str]:
    """One line per field given a boolean where the model wants no boolean (any section)."""
    problems: list[str] = []
    for key, value in raw.items():
        field = model.model_fields.get(str(key))
        if field is None:
            continue  # unknown fields are reported by validation, with their name
        where = f"{prefix}{key}"
        if isinstance(value, bool) and not _allows_bool(field.annotation):
            problems.append(
                f"  {where}: a boolean ({str(value).lower()}) is not a valid value here"
            )
        elif isinstance(value, dict):
            nested = _nested_model(field.annotation)
            if nested is not None:
                problems.extend(_booleans_as_numbers(value, nested, f"{where}."))
    return problems
