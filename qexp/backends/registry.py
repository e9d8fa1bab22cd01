"""Backends by name: `backend=<name>` in a config selects the class registered under that name."""

from __future__ import annotations

from typing import Type

from qexp.backends.base import Backend
from qexp.core.errors import ConfigError
from qexp.core.registry import Registry

BACKENDS: Registry[Type[Backend]] = Registry("backend")


def register_backend(cls: Type[Backend]) -> Type[Backend]:
    """Register a backend by name, and its config dataclass as `backend/<name>_schema` (the schema that
    conf/backend/<name>.yaml lists in its defaults)."""
    from hydra.core.config_store import ConfigStore

    BACKENDS.add(cls.name, cls)
    ConfigStore.instance().store(group="backend", name=f"{cls.name}_schema", node=cls.config_class)
    return cls


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}", f"choose one of: {', '.join(sorted(BACKENDS))}") from None
