"""A lock on one cache entry that works across processes and hosts sharing the cache folder (NFS included).

The lock is a file created with O_EXCL (atomic on local file systems and on NFSv3+) holding its holder's host, pid,
process start time and a random token. While held, a thread touches the file every HEARTBEAT_S seconds. A waiter
takes over a lock whose holder is gone: on the same host, a holder process that no longer exists (or a reused pid);
from another host, a file not touched for `stale_after_s`. Taking over goes through a second O_EXCL file, so two
waiters never both remove a lock, nor one remove a lock just created by the other.

flock(2) is not used: on NFS it depends on the client's lock daemon and lease handling, and it cannot say who holds a
lock, which is what a user waiting on a shared cache needs to know.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from qexp.core.errors import CacheLockError
from qexp.core.liveness import pid_start

log = logging.getLogger("qexp")

HEARTBEAT_S = 10.0
STALE_AFTER_S = 90.0  # several missed heartbeats: the holder's host is down, or the job was frozen
REPORT_EVERY_S = 300.0  # a waiter says whom it waits for at first and then every REPORT_EVERY_S


def _gone(holder: dict) -> bool:
    """Whether a holder on this host has died: its pid is gone, a zombie, or now another process (start time)."""
    now = pid_start(holder["pid"])
    return now is None or (holder.get("start") is not None and now != holder["start"])


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} since {started}"


class EntryLock:
    def __init__(self, path: Path, what: str, timeout_s: Optional[float] = None,
                 stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S):
        self.path = Path(path)
        self.what = what  # e.g. "qdq entry 1a2b...": for the messages
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start": pid_start(os.getpid()),
                   "token": secrets.token_hex(8)}
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    # ------------------------------------------------------------ holder side
    def _try_create(self, path: Path, content: dict) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump(content, handle)
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:  # taken over (we were frozen past stale_after_s) or the folder went away
                return

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock (waiting while a live holder has it, up to timeout_s); without `blocking`, False at once
        when a live holder has it."""
        began, reported = time.monotonic(), None
        while True:
            if self._try_create(self.path, {**self.me, "since": time.time()}):
                self._stop.clear()
                self._beat = threading.Thread(target=self._heartbeat, name="qexp-cache-lock", daemon=True)
                self._beat.start()
                return True
            holder = self._holder()
            if holder is None:
                continue  # released between our attempt and the read: try again at once
            if self._stale(holder):
                self._take_over(holder)
                continue
            if not blocking:
                return False
            waited = time.monotonic() - began
            if self.timeout_s is not None and waited >= self.timeout_s:
                raise CacheLockError(
                    f"waited {waited:.0f} s for the {self.what}, held by {describe(holder)}",
                    f"raise cache.lock_timeout_s, or, if that job is gone for good, delete {self.path}")
            if reported is None or waited - reported >= REPORT_EVERY_S:
                log.info("cache: waiting for the %s, being built by %s", self.what, describe(holder))
                reported = waited
            time.sleep(min(2.0, 0.05 * 2 ** min(int(waited), 5)))

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        holder = self._holder()
        if holder is not None and holder.get("token") == self.me["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "EntryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------ waiter side
    def held(self) -> Optional[dict]:
        """The live holder of this lock (None: free, or its holder is gone)."""
        holder = self._holder()
        return None if holder is None or self._stale(holder) else holder

    def _holder(self) -> Optional[dict]:
        """The lock file's content (None: no lock). A file still being written reads as a fresh lock of no one."""
        try:
            text = self.path.read_text()
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            holder = {"host": "?", "pid": "?", "token": None}
        holder["mtime"] = mtime
        return holder

    def _stale(self, holder: dict) -> bool:
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            return _gone(holder)
        return time.time() - holder["mtime"] > self.stale_after_s

    def _take_over(self, stale: dict) -> None:
        """Remove a stale lock, unless it changed hands meanwhile. One waiter at a time does this (`.break`)."""
        breaker = self.path.with_name(self.path.name + ".break")
        if not self._try_create(breaker, {**self.me, "since": time.time()}):
            try:  # a breaker killed in its few milliseconds here leaves its file behind
                if time.time() - breaker.stat().st_mtime > self.stale_after_s:
                    breaker.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return
        try:
            current = self._holder()
            if current is not None and current.get("token") == stale.get("token") and self._stale(current):
                log.warning("cache: the %s was locked by %s, which is gone: lock taken over", self.what,
                            describe(current))
                self.path.unlink(missing_ok=True)
        finally:
            breaker.unlink(missing_ok=True)
