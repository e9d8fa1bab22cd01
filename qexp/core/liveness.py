"""Dead-run reconciliation: a run whose process died (SIGKILL, OOM killer, a native segfault, power loss) cannot end
itself, so MLflow would show it RUNNING forever.

Every qexp run and sweep parent records who owns it: host, boot id, pid and the pid's start time (clock ticks since
boot, from /proc). The next time qexp touches the experiment, each RUNNING run owned by *this host* is checked: if
the machine rebooted since (boot id), or the pid is gone, or the pid now belongs to another process (start time),
the run is ended KILLED with the reason as a tag. A run owned by another host is never touched: its process may be
alive there. A run without the owner tags (logged by another tool, or by qexp before it recorded them) is left alone.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Dict, List, Optional

log = logging.getLogger("qexp")

HOST_TAG = "qexp.host"
BOOT_TAG = "qexp.boot_id"
PID_TAG = "qexp.pid"
PID_START_TAG = "qexp.pid_start"
KILLED_TAG = "qexp.killed_reason"
SLURM_JOB_TAG = "qexp.slurm_job_id"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_start(pid: int) -> Optional[str]:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the fields after the command name, which may hold spaces or ")"
    if fields[0] in ("Z", "X"):  # a zombie has died; it only waits for its parent to read its exit status
        return None
    return fields[19]


def slurm_job_id() -> Optional[str]:
    """This SLURM job's id as scancel and sacct take it: ARRAYJOB_TASK for an array task (a sweep), else the job id;
    None outside SLURM."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def owner_tags(pid: Optional[int] = None) -> Dict[str, str]:
    pid = pid or os.getpid()
    tags = {HOST_TAG: socket.gethostname(), BOOT_TAG: _boot_id(), PID_TAG: str(pid),
            PID_START_TAG: pid_start(pid) or ""}
    if os.environ.get("SLURM_JOB_ID") and pid == os.getpid():  # `scancel` / `sacct -j` it
        tags[SLURM_JOB_TAG] = slurm_job_id()
    return tags


def death_reason(tags: Dict[str, str], dead_pid: Optional[int] = None) -> Optional[str]:
    """Why the run's owning process is known to be dead, or None (alive, another host's, or unknown). `dead_pid`:
    a pid known to have died (the watchdog saw its pipe close), even if /proc still lists it for a moment."""
    host, pid = tags.get(HOST_TAG), tags.get(PID_TAG)
    if not host or not pid or host != socket.gethostname():
        return None
    if dead_pid is not None and pid == str(dead_pid):
        return f"its process {pid} on {host} died without ending the run (killed, out of memory, or a native crash)"
    if tags.get(BOOT_TAG) and tags[BOOT_TAG] != _boot_id():
        return f"host {host} rebooted since the run started (power loss or reboot)"
    start = pid_start(int(pid))
    if start is None:
        return f"its process {pid} on {host} is gone (killed, out of memory, or a native crash)"
    if tags.get(PID_START_TAG) and start != tags[PID_START_TAG]:
        return f"its process {pid} on {host} is gone (the pid now belongs to another process)"
    return None


def reconcile(client, experiment_id: str, dead_pid: Optional[int] = None) -> List[str]:
    """End this host's dead RUNNING runs of the experiment KILLED, with the reason. Returns their run ids."""
    host = socket.gethostname()
    runs = client.search_runs([experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = "
                              f"'{host}'", max_results=1000)
    killed = []
    for run in runs:
        reason = death_reason(run.data.tags, dead_pid)
        if reason is None:
            continue
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            client.set_tag(run.info.run_id, KILLED_TAG, f"{reason}; found by qexp pid {os.getpid()} at {stamp}")
            client.set_terminated(run.info.run_id, "KILLED")
        except Exception as exc:  # noqa: BLE001 - on a store with logins, another user's run is theirs to end
            if getattr(exc, "error_code", "") != "PERMISSION_DENIED":
                raise
            log.info("run %s was left RUNNING by a dead process; it belongs to another user of the store, who can "
                     "end it", run.info.run_id)
            continue
        killed.append(run.info.run_id)
        log.warning("run %s (%s) was left RUNNING by a dead process: marked KILLED (%s)",
                    run.info.run_id, run.info.run_name, reason)
    return killed
