"""Sweeps through real Hydra multirun (basic, joblib and submitit-local launchers) into a real MLflow store:
parent/child runs, resume by config hash, failure isolation, the report and the notebook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY

SWEEP = ["+sweep=quant_grid", *TINY, "tracking.experiment=sweeptest"]


def _multirun(args, cache_dir, store_uri, sweep_dir, timeout=600, sweep=SWEEP):
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": store_uri}
    return subprocess.run([sys.executable, "-m", "qexp", *sweep, *args, f"hydra.sweep.dir={sweep_dir}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _runs(store_uri, experiment="sweeptest"):
    client = MlflowClient(store_uri)
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=500)


def _parent(runs, sweep_dir):
    return next(r for r in runs if r.data.tags.get("sweep_dir") == str(Path(sweep_dir).resolve()))


@pytest.fixture(scope="module")
def sweeps(cache_dir, store_uri, tmp_path_factory):
    """Three invocations of one sweep: the first run, a re-run with a poisoned job, a widened re-run."""
    base = tmp_path_factory.mktemp("sweeps")
    cache_dir = tmp_path_factory.mktemp("sweep-cache")  # empty: the first job computes what the second reuses
    dirs = {name: base / name for name in ("first", "poisoned", "widened")}
    outs = {
        "first": _multirun(["quant=fp32,16a4w"], cache_dir, store_uri, dirs["first"]),
        # the tiny/16a4w job is already FINISHED (skipped); the checkpoint job has no checkpoint (fails alone)
        "poisoned": _multirun(["model=tiny,llama_checkpoint", "quant=16a4w"], cache_dir, store_uri, dirs["poisoned"]),
        # like re-running a killed sweep: only 8a8w is missing
        "widened": _multirun(["quant=fp32,16a4w,8a8w"], cache_dir, store_uri, dirs["widened"]),
    }
    return dirs, outs


def test_parent_and_children(sweeps, store_uri):
    dirs, outs = sweeps
    assert outs["first"].returncode == 0, outs["first"].stderr[-3000:]
    assert "2 finished, 0 failed, 0 skipped" in outs["first"].stdout
    client, runs = _runs(store_uri)
    parent = _parent(runs, dirs["first"])
    assert parent.data.tags["qexp.role"] == "sweep" and parent.info.status == "FINISHED"
    assert parent.data.metrics["jobs_finished"] == 2 and parent.data.metrics["jobs_total"] == 2
    assert "quant=fp32,16a4w" in parent.data.params["sweep.overrides"]
    assert "+sweep=quant_grid" in parent.data.tags["command"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.params["quant.name"] for r in children) == ["16a4w", "fp32"]
    for child in children:  # a child carries what a single run carries
        assert child.info.status == "FINISHED" and child.data.tags["qexp.sweep"] == "quant_grid"
        assert {"ppl_fp", "weights_mb", "time_eval_fp_s"} <= set(child.data.metrics)
        assert {"config_hash", "text_source", "eval_windows_sha256"} <= set(child.data.tags)
    # short distinct names, the sweep's result as the parent's description
    assert sorted(r.info.run_name for r in children) == ["tiny · 16a4w · RTN · none", "tiny · fp32 · RTN · none"]
    assert parent.data.tags["mlflow.note.content"].startswith("sweep quant_grid: 2 jobs (2 finished")
    # the FP phase is evaluated once and shared by the second job
    assert sorted(r.data.tags["fp_eval_cache_hit"] for r in children) == ["false", "true"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"sweep.yaml", "jobs.csv"} <= artifacts


def test_failed_job_is_isolated_and_finished_jobs_are_skipped(sweeps, store_uri):
    dirs, outs = sweeps
    out = outs["poisoned"]
    assert out.returncode == 1, out.stderr[-3000:]
    assert "0 finished, 1 failed, 1 skipped" in out.stdout
    assert "checkpoint" in out.stderr and "Traceback" not in out.stderr
    _, runs = _runs(store_uri)
    parent = _parent(runs, dirs["poisoned"])
    assert parent.info.status == "FAILED" and "checkpoint" in parent.data.tags["error"]
    assert parent.data.metrics["jobs_failed"] == 1 and parent.data.metrics["jobs_skipped"] == 1
    failed = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(failed) == 1 and failed[0].info.status == "FAILED" and "checkpoint" in failed[0].data.tags["error"]
    jobs = [json.loads(p.read_text()) for p in sorted(dirs["poisoned"].glob("*/qexp_job.json"))]
    assert sorted(j["status"] for j in jobs) == ["failed", "skipped"]


def test_rerun_does_only_what_is_missing(sweeps, store_uri):
    dirs, outs = sweeps
    out = outs["widened"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 finished, 0 failed, 2 skipped" in out.stdout
    _, runs = _runs(store_uri)
    parent = _parent(runs, dirs["widened"])
    new = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert [r.data.params["quant.name"] for r in new] == ["8a8w"]


def test_force_reruns(sweeps, cache_dir, store_uri, tmp_path):
    out = _multirun(["quant=fp32", "tracking.force=true"], cache_dir, store_uri, tmp_path / "forced")
    assert out.returncode == 0 and "1 finished, 0 failed, 0 skipped" in out.stdout, out.stderr[-3000:]


def test_joblib_runs_two_jobs_in_parallel(cache_dir, store_uri, tmp_path):
    out = _multirun(["quant=16a8w,8a4w", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                     "tracking.experiment=sweeptest_joblib"], cache_dir, store_uri, tmp_path / "joblib")
    assert out.returncode == 0, out.stderr[-3000:]
    _, runs = _runs(store_uri, "sweeptest_joblib")
    parent = _parent(runs, tmp_path / "joblib")
    assert parent.data.tags["launcher"].endswith("JoblibLauncher")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    a, b = sorted(children, key=lambda r: r.info.start_time)
    assert b.info.start_time < a.info.end_time, "the two jobs did not overlap: not run in parallel"


def test_submitit_local_launcher(cache_dir, store_uri, tmp_path):
    out = _multirun(["quant=fp32,16a4w", "hydra/launcher=submitit_local",
                     "tracking.experiment=sweeptest_submitit"], cache_dir, store_uri, tmp_path / "submitit")
    assert out.returncode == 0, out.stderr[-3000:]
    _, runs = _runs(store_uri, "sweeptest_submitit")
    parent = _parent(runs, tmp_path / "submitit")
    assert parent.data.tags["launcher"].endswith("LocalLauncher") and parent.data.metrics["jobs_total"] == 2
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    # a new experiment, so nothing to skip: both ran, each in a process submitit started
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)


def test_ad_hoc_multirun_gets_its_parent_run(cache_dir, store_uri, tmp_path):
    """`python -m qexp -m a=x,y` without a sweep file: the most common way to sweep gets the same bookkeeping."""
    out = _multirun(["-m", *TINY, "eval.limit=2", "quant=fp32,16a8w", "tracking.experiment=sweeptest_adhoc"],
                    cache_dir, store_uri, tmp_path / "adhoc", sweep=[])
    assert out.returncode == 0 and "2 finished, 0 failed, 0 skipped" in out.stdout, out.stderr[-3000:]
    assert "raised" not in out.stderr  # no callback warning from Hydra
    _, runs = _runs(store_uri, "sweeptest_adhoc")
    parent = _parent(runs, tmp_path / "adhoc")
    assert parent.info.status == "FINISHED" and parent.data.tags["qexp.sweep"] == "multirun"
    assert "quant=fp32,16a8w" in parent.data.params["sweep.overrides"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)


def test_failing_callback_fails_the_command_in_one_line(cache_dir, store_uri, tmp_path):
    import socket

    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = _multirun(["-m", *TINY, "quant=fp32,16a8w", f"tracking.uri=http://127.0.0.1:{port}"], cache_dir, store_uri,
                    tmp_path / "unreachable", sweep=[])
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("qexp: error:")]
    assert len(errors) == 1 and "on_multirun_start" in errors[0] and "unreachable" in errors[0]
    assert not (tmp_path / "unreachable" / "0").exists()  # no job ran


# ---------------------------------------------------------------- report
def test_report_table_and_plots(sweeps, store_uri, tmp_path):
    from qexp.report import main

    assert main(["--experiment", "sweeptest", "--sweep", "quant_grid", "--tracking-uri", store_uri,
                 "--out-dir", str(tmp_path), "--name", "grid"]) == 0
    md = (tmp_path / "grid.md").read_text()
    assert md.splitlines()[2].startswith(
        "Generated by `python -m qexp.report --experiment sweeptest --sweep quant_grid")
    for header in ("model", "scheme", "observer", "calibration", "KV mode", "backend", "target", "PPL FP", "PPL QDQ",
                   "Δ vs FP"):
        assert f" {header} " in md
    data = pd.read_csv(tmp_path / "grid.csv")
    assert sorted(data["scheme"]) == ["16a4w", "8a8w", "fp32"]
    assert data["weights_mb"].iloc[0] == data["weights_mb"].max()  # fp32 first: largest
    assert np.allclose(data["ppl_fp"], data["ppl_fp"].iloc[0])  # one FP model, one set of windows
    assert (tmp_path / "grid_ppl_vs_size.png").stat().st_size > 10_000
    assert "3 windows x 64 tokens" in md
    # attached to the sweep's (latest) parent run
    client, runs = _runs(store_uri)
    latest_parent = max((r for r in runs if r.data.tags.get("qexp.role") == "sweep"), key=lambda r: r.info.start_time)
    assert {"report/grid.md", "report/grid.csv"} <= {a.path for a in client.list_artifacts(latest_parent.info.run_id,
                                                                                            "report")}


def test_report_refuses_incomparable_runs(sweeps, compose, store_uri, tmp_path, capsys):
    from qexp.pipeline import run_experiment
    from qexp.report import build_report, load_runs, main

    run_experiment(compose(TINY + ["quant=fp32", "eval.limit=2", "tracking.experiment=sweeptest"]))
    args = ["--experiment", "sweeptest", "--tracking-uri", store_uri, "--out-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not comparable" in err and "window count=2" in err and "window count=3" in err and "--allow-mixed" in err
    assert not (tmp_path / "sweeptest.md").exists()
    report = build_report(load_runs("sweeptest", tracking_uri=store_uri), allow_mixed=True)
    assert {"windows", "window len"} <= set(report.table.columns)
    assert any("Mixed evaluation settings" in note for note in report.notes)


def test_report_pivot_and_errors(sweeps, store_uri):
    from qexp.report import ReportError, build_report, load_runs

    runs = load_runs("sweeptest", "quant_grid", tracking_uri=store_uri)
    report = build_report(runs, pivot=["model", "scheme", "ppl_qdq"])
    assert list(report.pivot.index) == ["tiny"] and "16a4w" in report.pivot.columns
    with pytest.raises(ReportError, match="no column"):
        build_report(runs, pivot=["model", "soc", "ppl_qdq"])
    with pytest.raises(ReportError, match="no MLflow experiment"):
        load_runs("no-such-experiment", tracking_uri=store_uri)
    with pytest.raises(ReportError, match="no FINISHED runs"):
        load_runs("sweeptest", "no-such-sweep", tracking_uri=store_uri)


def test_notebook_executes(sweeps, store_uri):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(REPO / "notebooks" / "compare.ipynb", as_version=4)
    env = {"QEXP_EXPERIMENT": "sweeptest", "QEXP_SWEEP": "quant_grid", "MLFLOW_TRACKING_URI": store_uri}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    # the MLflow section (the committed-results section above it draws from results/ whatever the store holds)
    sweep_cell = next(c for c in notebook.cells if c.cell_type == "code" and "load_runs(EXPERIMENT" in c.source)
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/markdown", "")) for o in sweep_cell.outputs)
    assert "3 runs of experiment 'sweeptest'" in text and "16a4w" in text and "PPL QDQ" in text
    assert any("image/png" in o.get("data", {}) for o in sweep_cell.outputs)
