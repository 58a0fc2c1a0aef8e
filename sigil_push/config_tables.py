"""ConfigError and the typed-table builder shared by `config.py` and every provider module.

It sits below both so that a provider module can declare and validate its own `relays.toml`
table without importing `config.py`, which lists the providers through the registry.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar
from urllib.parse import urlsplit


class ConfigError(Exception):
    """An invalid or unreadable configuration; `key` is the dotted name of the culprit."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


T = TypeVar("T")


def _expected_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = {
            "str": str, "int": int, "bool": bool, "float": float, "tuple[str, ...]": list,
        }[annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return typing.cast(type, annotation)


def parse_table(raw: Any, name: str, cls: type[T]) -> T:
    """Build dataclass `cls` from TOML table `raw`, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(name, "must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{name}.{key}", f"unknown key (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for key, spec in fields.items():
        if key not in raw:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{name}.{key}", "is required")
            continue
        value, expected = raw[key], _expected_type(spec.type)
        valid = isinstance(value, (int, float)) and not isinstance(value, bool) if expected is float else (
            type(value) is expected
        )
        if not valid:
            raise ConfigError(f"{name}.{key}", f"must be a {expected.__name__}")
        if expected in (int, float) and value < 0:
            raise ConfigError(f"{name}.{key}", "must not be negative")
        if expected is list:
            if not all(isinstance(item, str) for item in value):
                raise ConfigError(f"{name}.{key}", "must be a list of strings")
            value = tuple(value)
        values[key] = float(value) if expected is float else value
    return cls(**values)


def check_http_url(key: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, "must be an http:// or https:// URL")
