"""Constants shared by the tests (fixtures are in conftest.py, which tests never import)."""

import socket
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
