"""What the cache holds and who used it (`python -m qexp.cache list`), and pruning it by age or size."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from qexp.cache import COMPLETE, QUARANTINE, USES, lock_path
from qexp.cache.lock import EntryLock


@dataclass
class Entry:
    kind: str
    key: str
    path: Path
    bytes: int
    built: float
    last_use: float
    uses: int
    runs: List[str] = field(default_factory=list)


def _size(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def entries(root: Path) -> List[Entry]:
    found = []
    for kind_dir in sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")):
        for entry in sorted(p for p in kind_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if not (entry / COMPLETE).exists():
                continue
            built = (entry / COMPLETE).stat().st_mtime
            uses = []
            if (entry / USES).exists():
                for line in (entry / USES).read_text().splitlines():
                    try:
                        uses.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by a crash: the others still count
                        continue
            runs = list(dict.fromkeys(u["run_id"] for u in uses if u.get("run_id")))
            last = max([built] + [u.get("time", 0) for u in uses])
            found.append(Entry(kind_dir.name, entry.name, entry, _size(entry), built, last, len(uses), runs))
    return found


def leftovers(root: Path, min_age_s: float = 3600) -> List[Path]:
    """Quarantined entries, and build directories older than `min_age_s` that no live build owns (a killed build's
    temporary copy)."""
    root = Path(root)
    out = sorted((root / QUARANTINE).iterdir()) if (root / QUARANTINE).is_dir() else []
    now = time.time()
    for kind_dir in (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out += [p for p in kind_dir.iterdir() if p.is_dir() and p.name.startswith(".")
                and now - p.stat().st_mtime > min_age_s and not _locked(kind_dir, p.name.split('.')[1])]
    return out


def _locked(kind_dir: Path, key: str) -> bool:
    """Whether a live process holds this key's lock (building it, or reading it) right now."""
    return EntryLock(lock_path(kind_dir, key), f"cache entry {key}").held() is not None


def _remove_entry(entry: Entry) -> bool:
    """Remove an entry unless a process is building or reading it right now (its lock is held)."""
    entry_lock = EntryLock(lock_path(entry.path.parent, entry.key), f"{entry.kind} cache entry {entry.key}")
    if not entry_lock.acquire(blocking=False):
        return False
    try:
        doomed = entry.path.with_name(f".{entry.key}.pruned.{os.getpid()}")
        os.rename(entry.path, doomed)  # gone for readers at once; the files go after
        shutil.rmtree(doomed, ignore_errors=True)
    finally:
        entry_lock.release()
    return True


def prune(root: Path, max_bytes: Optional[int] = None, older_than_s: Optional[float] = None,
          keep_run: Optional[str] = None, dry_run: bool = False) -> List[Entry]:
    """Remove entries unused for `older_than_s`, then least recently used ones until the cache fits `max_bytes`.
    Never removes an entry `keep_run` used. Quarantined entries and stale build directories always go. Returns the
    removed (or, with dry_run, removable) entries."""
    root = Path(root)
    if not root.is_dir():
        return []
    if not dry_run:
        for path in leftovers(root):
            shutil.rmtree(path, ignore_errors=True)
    candidates = sorted(entries(root), key=lambda e: e.last_use)
    total = sum(e.bytes for e in candidates)
    now, removed = time.time(), []
    for entry in candidates:
        old = older_than_s is not None and now - entry.last_use > older_than_s
        over = max_bytes is not None and total > max_bytes
        if not (old or over) or (keep_run and keep_run in entry.runs):
            continue
        if dry_run or _remove_entry(entry):
            removed.append(entry)
            total -= entry.bytes
    return removed
