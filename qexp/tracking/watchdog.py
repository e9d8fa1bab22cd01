"""A watchdog for the run's process, so a death that Python cannot catch (SIGKILL, the OOM killer, a segfault in a
native library such as QNN's HTP emulator) still ends its runs KILLED at once, with one line on the terminal.

The first time a process touches an experiment it starts `python -m qexp.tracking.watchdog PID URI` in its own
session, connected by a pipe. The process writes each experiment id it touches to the pipe, and "ok" when it exits
normally (atexit). If the pipe closes without "ok", the process died: the watchdog reconciles those experiments
(liveness.reconcile) and prints what it marked. The watchdog imports nothing heavy until then. Without it, the same
reconciliation happens the next time qexp touches the experiment.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from typing import IO, Optional

_pipe: Optional[IO[str]] = None
_watched: set = set()


def watch(uri: str, experiment_id: str) -> None:
    """Have a watchdog reconcile `experiment_id` if this process dies without exiting normally."""
    global _pipe
    if os.environ.get("QEXP_WATCHDOG", "1") == "0":
        return
    if _pipe is None:
        read_end, write_end = os.pipe()
        subprocess.Popen([sys.executable, "-m", "qexp.tracking.watchdog", str(os.getpid()), uri], stdin=read_end,
                         stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        os.close(read_end)
        _pipe = os.fdopen(write_end, "w", buffering=1)
        atexit.register(_exited_normally)
    if experiment_id not in _watched:
        _watched.add(experiment_id)
        _pipe.write(f"{experiment_id}\n")


def _exited_normally() -> None:
    try:
        _pipe.write("ok\n")
        _pipe.close()
    except OSError:
        pass


def _main(pid: int, uri: str) -> None:
    import logging
    import signal

    logging.getLogger("qexp").addHandler(logging.NullHandler())  # its one line per run is printed below
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the run; it reports its own interruption
    experiments, last = [], ""
    for line in sys.stdin:
        last = line.strip()
        if last and last != "ok":
            experiments.append(last)
    if last == "ok" or not experiments:
        return
    from mlflow.tracking import MlflowClient

    from qexp.core.liveness import reconcile

    client = MlflowClient(uri)
    for experiment_id in experiments:
        for run_id in reconcile(client, experiment_id, dead_pid=pid):
            reason = client.get_run(run_id).data.tags.get("qexp.killed_reason", "")
            print(f"qexp: error: run {run_id} ended KILLED: {reason}", file=sys.stderr)


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2])
