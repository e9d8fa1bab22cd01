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


HTP_SMALL = ["backend=htp", "backend.bench.emulator=true", "backend.prefill_ar_len=16", "backend.eval_tokens=64",
             "backend.bench.prompt_len=8", "backend.bench.repeats=1", "backend.bench.warmup=0"]


def test_native_output_goes_to_the_run_not_the_terminal(cache_dir, store_uri, tmp_path):
    """QNN's compile progress and ExecuTorch's runtime INFO lines land in the run's native.log artifact; the
    terminal keeps qexp's own lines. verbose=true shows them live."""
    from mlflow.tracking import MlflowClient

    quiet = _qexp(TINY + ["quant=16a8w", "backend.model_mode=kv", *HTP_SMALL], cache_dir, store_uri)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    terminal = quiet.stdout + quiet.stderr
    assert "[Qnn ExecuTorch]" not in terminal and "qexp: run " in quiet.stdout
    assert "Visiting:" not in terminal  # ExecuTorch's per-node QNN preprocess INFO lines go to run.log
    run_id = quiet.stdout.split("qexp: run ")[1].split()[0]
    native = MlflowClient(store_uri).download_artifacts(run_id, "native.log", str(tmp_path))
    assert "[Qnn ExecuTorch]" in open(native).read()
    loud = _qexp(TINY + ["quant=16a8w", "backend.model_mode=kv", *HTP_SMALL, "verbose=true"], cache_dir, store_uri)
    assert loud.returncode == 0 and "[Qnn ExecuTorch]" in loud.stdout + loud.stderr
