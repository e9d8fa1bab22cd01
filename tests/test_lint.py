"""The code passes the linter: ruff with pyproject.toml's [tool.ruff] settings (the same check .pre-commit-config.yaml
runs before a commit)."""

import importlib.util
import subprocess
import sys

import pytest

from helpers import REPO

PATHS = ["qexp", "tests", "benchmarks", "diagnostics", "scripts"]


def test_ruff_reports_nothing():
    if importlib.util.find_spec("ruff") is None:
        # a failure, not a skip: ruff is a pinned test dependency (requirements.txt), so its absence is a broken setup
        pytest.fail(f"ruff is not installed in {sys.executable}: run `make setup`")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", *PATHS], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"ruff check {' '.join(PATHS)} failed:\n{out.stdout}{out.stderr}"


def test_the_package_declares_its_dependencies():
    """pyproject.toml takes its dependencies from requirements.txt, so `pip install -e .` into an existing environment
    states what is missing (the installed metadata lists the pins)."""
    from importlib.metadata import requires

    declared = requires("qexp") or []
    for pin in ("torch==2.13.0", "executorch==1.5.1", "mlflow==3.17.2", "hydra-core==1.3.2"):
        assert pin in declared, f"{pin} not in qexp's declared dependencies (re-run `make setup`): {declared}"
