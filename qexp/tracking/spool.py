"""A run's record kept on disk while its store is away, and uploaded once it is back.

A spool is one folder per run, `<tracking.spool_dir>/<run id>/`: `record.jsonl` (a header with the store and the run,
then one line per write, in order, each flushed to disk) and `files/` (the artifacts and datasets those lines name).
`python -m qexp.store replay` sends the writes to the store with the same functions a live run uses
(writer.py's SENDERS) and renames the folder `<run id>.replayed`; a replay cut short is simply run again (every
write is idempotent). The store's address is kept with its credentials masked: the replay logs in as the run did,
through MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from qexp.core.redact import redact_text

RECORD = "record.jsonl"
REPLAYED = ".replayed"


class Spool:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        record = self.folder / RECORD
        self._count = len(record.read_text().splitlines()) if record.exists() else 0

    @classmethod
    def create(cls, root: Path, uri: str, run_id: str) -> "Spool":
        folder = Path(root) / run_id
        (folder / "files").mkdir(parents=True, exist_ok=True, mode=0o700)
        spool = cls(folder)
        if spool._count == 0:
            spool._append({"op": "run", "uri": redact_text(uri), "run_id": run_id})
        return spool

    def add(self, op: str, payload: Dict[str, Any]) -> None:
        """Keep one write: files it names are copied into the spool first, so the record never points at a
        temporary file the run has since deleted."""
        payload = dict(payload)
        place = self.folder / "files" / f"{self._count:05d}"
        if op == "artifact":
            place.mkdir(parents=True, exist_ok=True)
            copy = place / Path(payload["local"]).name
            shutil.copyfile(payload["local"], copy)
            payload["local"] = str(copy.relative_to(self.folder))
        elif op == "dataset":
            import numpy as np

            place.mkdir(parents=True, exist_ok=True)
            features = payload["features"]  # an array, or {name: array} (calibration's {"input_ids": ...})
            arrays = features if isinstance(features, dict) else {"": features}
            np.savez(place / "features.npz", **{name: np.asarray(a) for name, a in arrays.items()})
            payload["features"] = str((place / "features.npz").relative_to(self.folder))
        self._append({"op": op, **payload})

    def _append(self, line: Dict[str, Any]) -> None:
        with open(self.folder / RECORD, "a") as handle:
            handle.write(json.dumps(line) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self._count += 1


@dataclass
class Replayed:
    run_id: str
    uri: str
    counts: Dict[str, int]
    status: Optional[str]

    def describe(self) -> str:
        what = ", ".join(f"{n} {op}" for op, n in self.counts.items())
        return f"run {self.run_id}: {what} sent to {self.uri}" + (f"; ended {self.status}" if self.status else "")


def pending(root: Path) -> List[Path]:
    """The spool folders under `root` (or `root` itself, one run's folder) not yet replayed."""
    root = Path(root)
    if (root / RECORD).exists():
        return [] if root.name.endswith(REPLAYED) else [root]
    return sorted(p for p in root.iterdir() if (p / RECORD).exists() and not p.name.endswith(REPLAYED)) \
        if root.is_dir() else []


def replay(folder: Path, senders: Dict[str, Callable], uri: Optional[str] = None) -> Replayed:
    """Send one spooled run's writes to its store (or `uri`) with `senders` (writer.SENDERS: what a live run sends
    for each kind of write), then mark the folder replayed."""
    from mlflow.tracking import MlflowClient

    folder = Path(folder)
    lines = [json.loads(line) for line in (folder / RECORD).read_text().splitlines() if line.strip()]
    header, writes = lines[0], lines[1:]
    target = uri or header["uri"]
    client = MlflowClient(target)
    run = client.get_run(header["run_id"])  # the run exists there (it was created before the store went away)
    counts: Dict[str, int] = {}
    status, spooled_tags = None, set()
    for write in writes:
        op = write.pop("op")
        for key in ("local", "features"):
            if key in write:
                write[key] = str(folder / write[key])
        senders[op](client, header["run_id"], write)
        counts[op] = counts.get(op, 0) + _items(op, write)
        status = write["status"] if op == "end" else status
        spooled_tags |= set(write.get("tags", {})) if op == "tags" else set()
    from qexp.core.liveness import KILLED_TAG

    if status is not None and KILLED_TAG in run.data.tags and KILLED_TAG not in spooled_tags:
        # a qexp process on this host found the run RUNNING with its process gone, before this replay, and marked
        # it KILLED (liveness.py): the spool says how it really ended
        client.delete_tag(header["run_id"], KILLED_TAG)
    folder.rename(folder.with_name(folder.name + REPLAYED))
    return Replayed(header["run_id"], redact_text(target), counts, status)


def _items(op: str, write: Dict[str, Any]) -> int:
    return len(write.get(op, ())) if op in ("params", "tags", "metrics") else 1
