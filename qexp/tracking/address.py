"""Where a run's MLflow store is: the embedded one in the repository (sqlite:///<repo>/mlruns.db), $MLFLOW_TRACKING_URI
or `tracking.uri` (a server), and a sqlite store's first opening, which must happen once at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator, Optional

from qexp.core.config import TrackingConfig
from qexp.core.provenance import REPO_ROOT


def embedded_store_uri(root: Path = REPO_ROOT) -> str:
    return f"sqlite:///{root / 'mlruns.db'}"


def sqlite_file(uri: str) -> Optional[str]:
    """The file of a `sqlite:///` store URI, None for any other store."""
    return uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def sqlite_initialised_once(uri: str) -> Iterator[None]:
    """Around the first access to a sqlite store: create its file readable by its owner only (MLflow would make it
    world-readable), and hold a file lock, because MLflow creates and migrates the schema on first access and two
    processes doing so at once fail with "duplicate column name" (measured: two sweeps started together)."""
    if sqlite_file(uri) is None:
        yield
        return
    path = Path(sqlite_file(uri))
    if not path.parent.is_dir():
        yield
        return
    with open(path.with_name(path.name + ".qexp-init.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if not path.exists():
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_uri(cfg: TrackingConfig) -> str:
    return cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri()
