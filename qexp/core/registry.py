"""One registry helper for every extension point (algorithms, backends, model families): a name maps to one
extension, and registering a name a second time with another object is refused at import, so a new extension can
never silently replace an old one (or a copy-pasted class keep its template's name)."""

from __future__ import annotations

from typing import Dict, TypeVar

T = TypeVar("T")


class Registry(Dict[str, T]):
    """name -> extension, for one kind of extension ("algorithm", "backend", "model family")."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, extension: T) -> T:
        if name in self and self[name] is not extension and self[name] != extension:
            raise ValueError(f"{self.kind} {name!r} is registered twice: {self[name]!r} and {extension!r}; "
                             f"give the new {self.kind} its own name")
        self[name] = extension
        return extension
