"""The tasks of a run (eval.tasks): qexp's offline tasks built from the texts (their items cached by content), the
user's task folders, lm-eval's own tasks; with a content hash per task, so a cached phase result is reused only for
the same items."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from qexp.cache import Cache, stable_hash
from qexp.tasks.offline import (TASK_VERSION, build_items, describe, parse_task_name, template_hash,
                                write_task_yaml)


@dataclass
class TaskSuite:
    names: List[str]
    include_paths: List[str]  # lm-eval include paths: qexp's generated YAMLs, then eval.task_paths
    hashes: Dict[str, str]  # task -> sha256 of its items (qexp tasks) or of its folder's files (the user's)
    described: Dict[str, str] = field(default_factory=dict)  # qexp task -> text it was built from
    limit: Optional[int] = None
    _tmp: Optional[tempfile.TemporaryDirectory] = None

    def key(self) -> str:
        """What a phase's task results depend on besides the program."""
        return stable_hash({"tasks": self.names, "hashes": self.hashes, "limit": self.limit,
                            "task_files": template_hash(), "version": TASK_VERSION}, length=24)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def prepare_suite(cfg, cache: Cache) -> TaskSuite:
    from qexp.data.text import load_corpus

    names = list(cfg.eval.tasks)
    tmp = tempfile.TemporaryDirectory(prefix="qexp-tasks-")
    root = Path(tmp.name)
    hashes, described = {}, {}
    for name in names:
        parsed = parse_task_name(name)
        if parsed is None:
            continue
        kind, text = parsed
        corpus = load_corpus(cfg.text, cache, source=text)
        key = stable_hash({"kind": kind, "text": corpus.sha256, "version": TASK_VERSION})

        def build(tmp_dir, kind=kind, corpus=corpus):
            data = build_items(kind, list(corpus.test["text"]))
            (tmp_dir / "data.jsonl").write_bytes(data)
            return {"sha256": hashlib.sha256(data).hexdigest(), "items": data.count(b"\n")}

        entry, _ = cache.get_or_build("tasks", key, build)
        sha256 = cache.meta("tasks", key)["sha256"]
        hashes[name] = sha256
        described[name] = describe(corpus.source, corpus.sha256)
        write_task_yaml(kind, text, entry / "data.jsonl", sha256, described[name], root)
    user_paths = [str(Path(p).expanduser().resolve()) for p in cfg.eval.get("task_paths") or []]
    folders = stable_hash([_folder_hash(p) for p in user_paths])
    for name in names:
        hashes.setdefault(name, folders)
    return TaskSuite(names, [str(root), *user_paths], hashes, described, cfg.eval.get("task_limit"), tmp)


def _folder_hash(path: str) -> str:
    digest = hashlib.sha256()
    for file in sorted(Path(path).rglob("*")):
        if file.is_file():
            digest.update(str(file.relative_to(path)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
