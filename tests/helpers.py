"""Constants shared by the tests (fixtures are in conftest.py, which tests never import)."""

import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"

# Tiny model, short windows: a whole experiment takes seconds.
TINY = [
    "model=tiny",
    "eval.seq_len=64",
    "eval.limit=3",
    "calibration.limit=3",
]


def free_port() -> int:
    """A loopback port nobody listens on (for a test server, or an unreachable one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    """Poll an MLflow server's /health until it answers; kill `proc` and fail if it never does."""
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(url.rstrip("/") + "/health", timeout=1).ok:
                return
        except requests.RequestException:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"{what} did not start")
