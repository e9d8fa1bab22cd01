"""Content-addressed cache for derived artifacts (dequantized models, calibrated programs, ...).

An entry is a directory `<root>/<kind>/<key>/`, where key is a hash of everything that determines its content.
It is built in a temporary sibling directory and renamed into place, so a reader never sees a half-written entry
and concurrent builders of the same key are safe (the loser discards its copy). A `lock` serialises builders
of one key within a machine so they do not do the same expensive work twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Cache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.expanduser(str(root)))

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def has(self, kind: str, key: str) -> bool:
        return (self.path(kind, key) / ".complete").exists()

    @contextlib.contextmanager
    def lock(self, kind: str, key: str) -> Iterator[None]:
        lock_dir = self.root / kind
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f".{key}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict | None]) -> tuple[Path, bool]:
        """Return (entry directory, hit). `build(tmp_dir)` writes the entry's files and may return metadata."""
        final = self.path(kind, key)
        if self.has(kind, key):
            return final, True
        with self.lock(kind, key):
            if self.has(kind, key):  # built by someone else while we waited
                return final, True
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
            try:
                meta = build(tmp) or {}
                (tmp / ".complete").write_text(json.dumps(meta, default=str))
                if final.exists():  # an incomplete leftover of a killed build
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final, False

    def meta(self, kind: str, key: str) -> dict:
        return json.loads((self.path(kind, key) / ".complete").read_text())
