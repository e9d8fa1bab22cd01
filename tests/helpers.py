"""Constants shared by the tests (fixtures are in conftest.py, which tests never import)."""

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
