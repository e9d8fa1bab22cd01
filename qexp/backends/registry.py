"""Backends by name: `backend=<name>` in a config selects the class registered under that name."""

from __future__ import annotations

from typing import Dict, Type

from qexp.backends.base import Backend
from qexp.errors import ConfigError

BACKENDS: Dict[str, Type[Backend]] = {}


def register_backend(cls: Type[Backend]) -> Type[Backend]:
    if cls.name in BACKENDS and BACKENDS[cls.name] is not cls:
        raise ValueError(f"backend {cls.name!r} is registered twice ({BACKENDS[cls.name]} and {cls})")
    BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}", f"choose one of: {', '.join(sorted(BACKENDS))}") from None
