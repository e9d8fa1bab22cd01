"""`python -m qexp.ui` (`make ui`): start the MLflow UI on qexp's store and print, per experiment, the address that
opens its runs table in qexp's view (see qexp/tracking/ui_view.py for why the address matters).

    python -m qexp.ui                      # the embedded store (or $MLFLOW_TRACKING_URI), on 127.0.0.1:5000
    python -m qexp.ui --port 5001 --experiment sweeps
    python -m qexp.ui --prepare-only       # only give qexp's experiments their view; start nothing

With a tracking server (http URI) nothing is started: the addresses point at that server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

from qexp.core.errors import QexpError


def qexp_experiments(client, only: Optional[str] = None) -> List[Tuple[object, int]]:
    """(experiment, number of runs) for each experiment holding qexp runs (they carry a config hash)."""
    found = []
    for experiment in client.search_experiments():
        if only and experiment.name != only:
            continue
        runs = client.search_runs([experiment.experiment_id], "tags.config_hash LIKE '%'", max_results=1000)
        if runs or experiment.name == only:
            found.append((experiment, len(runs)))
    return found


def prepare(uri: str, only: Optional[str] = None) -> List[Tuple[object, int]]:
    """Give every qexp experiment of the store its kind, description and view (older experiments included)."""
    import mlflow

    from qexp.tracking.store import describe_experiment

    client = mlflow.tracking.MlflowClient(uri)
    experiments = qexp_experiments(client, only)
    if only and not experiments:
        raise QexpError(f"no experiment {only!r} in {uri}", "see `python -m qexp.ui` without --experiment")
    for experiment, _ in experiments:
        describe_experiment(experiment, client)
    return experiments


def main(argv: Optional[Sequence[str]] = None) -> int:
    from qexp.core.config import TrackingConfig
    from qexp.core.redact import redact_text
    from qexp.tracking.address import resolve_uri, sqlite_file
    from qexp.tracking.ui_view import landing_url

    parser = argparse.ArgumentParser(prog="python -m qexp.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--experiment", help="only this experiment (default: every experiment with qexp runs)")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI or the embedded store")
    parser.add_argument("--prepare-only", action="store_true", help="install qexp's view; do not start the UI")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or resolve_uri(TrackingConfig())
    store_file = sqlite_file(uri)
    if store_file is not None and not os.path.isfile(store_file):
        # opening a missing sqlite store would create an empty one (and print MLflow's migration lines): say so instead
        print(f"qexp.ui: no qexp store at {store_file} yet (`make run` makes one, or pass --tracking-uri)")
        return 0
    try:
        experiments = prepare(uri, args.experiment)
    except QexpError as exc:
        print(f"qexp.ui: error: {exc}", file=sys.stderr)
        return 2
    served_elsewhere = uri.startswith(("http://", "https://"))
    base = uri if served_elsewhere else f"http://{args.host}:{args.port}"
    for experiment, n_runs in experiments:
        print(f"qexp.ui: {experiment.name} ({n_runs} runs): {redact_text(landing_url(base, experiment.experiment_id))}")
    if not experiments:
        print(f"qexp.ui: no qexp runs in {redact_text(uri)} yet (`make run` makes one)")
    if args.prepare_only or served_elsewhere:
        return 0
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", args.host,
               "--port", str(args.port)]
    # MLflow 3 starts job consumers (GenAI issue detection, ...) with 25 worker processes by default: qexp uses
    # none of them, and on a 2-core machine they load it more than the UI does.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return serve(command, env)


def serve(command: List[str], env: dict) -> int:
    """Run the UI until Ctrl-C or SIGTERM, then stop it and everything it started: `mlflow ui` ignores SIGTERM
    and leaves its uvicorn workers behind (measured), so it runs in its own process group and the group is ended."""
    server = subprocess.Popen(command, env=env, start_new_session=True)

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, grace in ((signal.SIGINT, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # workers that outlived their parent


if __name__ == "__main__":
    sys.exit(main())
