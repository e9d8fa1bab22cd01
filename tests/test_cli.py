"""`python -m qexp`: bad input gets one readable line and a non-zero exit, never a long traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO, TINY


def _qexp(args, cache_dir, store_uri, timeout=300):
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": store_uri}
    return subprocess.run([sys.executable, "-m", "qexp", *args, "tracking.experiment=cli"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _error_lines(stderr: str):
    return [line for line in stderr.splitlines() if "error" in line.lower() and "Warning" not in line]


def test_unknown_group_value(cache_dir, store_uri):
    out = _qexp(["quant=16a5w"], cache_dir, store_uri)
    assert out.returncode != 0
    assert "Available options" in out.stderr and "16a4w" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_checkpoint_one_line(cache_dir, store_uri, tmp_path):
    out = _qexp(["model=llama_checkpoint", f"model.checkpoint={tmp_path}/x.pth", f"model.params={tmp_path}/p.json",
                 f"model.tokenizer={tmp_path}/t.model"], cache_dir, store_uri)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("qexp: error:")]
    assert len(errors) == 1 and "checkpoint not found" in errors[0] and "model.checkpoint=" in errors[0]
    assert "Traceback" not in out.stderr


def test_invalid_scheme_one_line(cache_dir, store_uri):
    out = _qexp(TINY + ["quant.scheme=16a5w"], cache_dir, store_uri)
    assert out.returncode == 2
    assert "qexp: error: unknown quantization scheme '16a5w'" in out.stderr and "Traceback" not in out.stderr


def test_tiny_experiment_runs(cache_dir, store_uri):
    out = _qexp(TINY + ["quant=16a4w"], cache_dir, store_uri)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ppl_fp=" in out.stdout and "ppl_qdq=" in out.stdout
