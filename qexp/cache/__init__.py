"""Content-addressed cache for derived artifacts (dequantized models, calibrated programs, ...).

An entry is a directory `<root>/<kind>/<key>/`, where key is a hash of everything that determines its content.
It is built in a temporary sibling directory and renamed into place, so a reader never sees a half-written entry
and concurrent builders of the same key are safe (the loser discards its copy). A `lock` per key (a lock file that
works on a shared folder, `qexp.cache.lock`) serialises its builders across processes and hosts: the second job that
needs an entry being built waits for it and reuses it instead of computing it again.

An entry heals: its `.manifest.json` records every file's size and xxh3 hash, and every read checks them. A missing,
truncated or corrupt entry is moved to `<root>/.quarantine/`, rebuilt with a warning, and the run goes on. Each read
appends to the entry's `.uses.jsonl` (time, run id), which `python -m qexp.cache list` shows and `prune` uses
(least recently used first).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

from qexp.core.hashing import stable_hash  # noqa: F401 - the cache keys' hash, imported from here by the stages

log = logging.getLogger("qexp")

COMPLETE = ".complete"  # the entry's metadata; its presence marks the entry complete
MANIFEST = ".manifest.json"  # {relative path: {"size": bytes, "xxh3": hex}} of every file of the entry
USES = ".uses.jsonl"  # one line per build or read: {"time": epoch s, "event": "build" | "hit", "run_id": ...}
BOOKKEEPING = (COMPLETE, MANIFEST, USES)
QUARANTINE = ".quarantine"


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_xxh3(path: str | os.PathLike) -> str:
    """A fast content check (23 GB/s here against sha256's 1.2): integrity, not security."""
    import xxhash

    with open(path, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()


def entry_files(entry: Path) -> Iterator[Path]:
    for path in sorted(entry.rglob("*")):
        if (path.is_symlink() or path.is_file()) and not (path.parent == entry and path.name in BOOKKEEPING):
            yield path


def _fingerprint(path: Path) -> dict:
    if path.is_symlink():  # e.g. the QNN SDK entry links the wheel's libraries: the link is the content
        return {"link": os.readlink(path)}
    return {"size": path.stat().st_size, "xxh3": file_xxh3(path)}


def manifest_of(entry: Path) -> Dict[str, dict]:
    return {str(p.relative_to(entry)): _fingerprint(p) for p in entry_files(entry)}


def damage(entry: Path) -> Optional[str]:
    """What is wrong with a complete entry's files, or None. An entry written before manifests existed gets one now
    (trusted as it is)."""
    manifest_path = entry / MANIFEST
    if not manifest_path.exists():
        _write_json(manifest_path, manifest_of(entry))
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest ({type(exc).__name__})"
    for name, expected in manifest.items():
        path = entry / name
        if "link" in expected:
            if not path.is_symlink() or os.readlink(path) != expected["link"] or not path.exists():
                return f"{name} no longer links to an existing {expected['link']}"
            continue
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} is {size} bytes, expected {expected['size']} (truncated or overwritten)"
        if file_xxh3(path) != expected["xxh3"]:
            return f"{name} does not match its hash (corrupt)"
    return None


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, path)


def check_cache_dir(root: str | os.PathLike) -> None:
    """Refuse a cache folder that cannot be created or written, before any work (one line, how to fix)."""
    path = Path(os.path.expanduser(str(root)))
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check."):
            pass
    except OSError as exc:
        from qexp.core.errors import ConfigError

        raise ConfigError(f"cache_dir={root} cannot be used: {exc.strerror or exc}",
                          "point cache_dir (or QEXP_CACHE_DIR) at a folder this user can create and write") from None


LOCK_SUFFIX = ".lockfile"  # `<root>/<kind>/.<key>.lockfile` (`.<key>.lock` files are flock(2)'s, from older code)


def lock_path(kind_dir: Path, key: str) -> Path:
    return Path(kind_dir) / f".{key}{LOCK_SUFFIX}"


class Cache:
    def __init__(self, root: str | os.PathLike, lock_timeout_s: Optional[float] = None):
        self.root = Path(os.path.expanduser(str(root)))
        self.run_id: Optional[str] = None  # recorded in each entry's .uses.jsonl (set by the pipeline)
        # how long to wait for an entry another job is building (None: as long as that job lives)
        self.lock_timeout_s = lock_timeout_s

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def has(self, kind: str, key: str) -> bool:
        return (self.path(kind, key) / COMPLETE).exists()

    def _record_use(self, entry: Path, event: str = "hit") -> None:
        with open(entry / USES, "a") as f:
            f.write(json.dumps({"time": round(time.time(), 1), "event": event, "run_id": self.run_id}) + "\n")

    def _quarantine(self, kind: str, key: str, problem: str) -> Path:
        target = self.root / QUARANTINE / f"{kind}-{key}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.path(kind, key), target)
        log.warning("cache: %s entry %s is damaged (%s): moved to %s and rebuilt", kind, key, problem, target)
        return target

    def _usable(self, kind: str, key: str) -> bool:
        """A complete, undamaged entry (its use recorded). A damaged one is quarantined; the caller rebuilds it."""
        if not self.has(kind, key):
            return False
        problem = damage(self.path(kind, key))
        if problem is None:
            self._record_use(self.path(kind, key))
            return True
        self._quarantine(kind, key, problem)
        return False

    @contextlib.contextmanager
    def lock(self, kind: str, key: str) -> Iterator[None]:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner only: entries hold user models and data
        from qexp.cache.lock import EntryLock

        lock_dir = self.root / kind
        lock_dir.mkdir(parents=True, exist_ok=True)
        with EntryLock(lock_path(lock_dir, key), f"{kind} cache entry {key}", self.lock_timeout_s):
            yield

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict | None]) -> tuple[Path, bool]:
        """Return (entry directory, hit). `build(tmp_dir)` writes the entry's files and may return metadata."""
        final = self.path(kind, key)
        with self.lock(kind, key):  # also keeps a reader from checking an entry another process quarantines
            if self._usable(kind, key):
                return final, True
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
            try:
                meta = build(tmp) or {}
                _write_json(tmp / MANIFEST, manifest_of(tmp))
                (tmp / COMPLETE).write_text(json.dumps(meta, default=str))
                self._record_use(tmp, "build")
                if final.exists():  # an incomplete leftover of a killed build
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    from qexp.core.errors import CacheFullError

                    raise CacheFullError(
                        f"no room to write the {kind} cache entry under {self.root} ({exc.strerror})",
                        "free disk space, `python -m qexp.cache prune --max-gb N`, or point QEXP_CACHE_DIR elsewhere",
                    ) from exc
                raise
        return final, False

    def meta(self, kind: str, key: str) -> dict:
        return json.loads((self.path(kind, key) / COMPLETE).read_text())
