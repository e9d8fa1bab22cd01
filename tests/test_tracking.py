"""MLflow: a whole tiny experiment lands in a real embedded store and in a real `mlflow server` on loopback; a failed
run ends FAILED with its error; an unreachable server is one clear error before any work."""

from __future__ import annotations

import os

import subprocess
import sys
import time

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY, free_port
from qexp.core.errors import TrackingError
from qexp.pipeline import run_experiment

EXPECTED_METRICS = {
    "ppl_fp", "ppl_qdq", "word_ppl_fp", "word_ppl_qdq", "bits_per_byte_fp", "bits_per_byte_qdq",
    "byte_ppl_fp", "byte_ppl_qdq", "ppl_qdq_vs_fp", "top1_agreement_qdq_vs_fp", "logits_sqnr_db_qdq_vs_fp",
    "time_load_s", "time_text_s", "time_eval_fp_s", "time_quantize_s", "time_eval_qdq_s", "time_total_s",
    "peak_rss_mb", "model_params", "calibration_tokens",
}
EXPECTED_TAGS = {
    "git_commit", "config_hash", "version.torch", "version.executorch", "version.qnn_libs", "model_sha256",
    "text_source", "text_sha256", "host", "eval_windows_sha256", "calibration_sha256",
}


def _check_run(client: MlflowClient, run_id: str, cfg):
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert EXPECTED_METRICS <= set(run.data.metrics), EXPECTED_METRICS - set(run.data.metrics)
    assert EXPECTED_TAGS <= set(run.data.tags), EXPECTED_TAGS - set(run.data.tags)
    params = run.data.params
    assert params["quant.scheme"] == cfg.quant.scheme and params["model.name"] == "tiny"
    assert params["eval.window_len"] == str(cfg.eval.seq_len) and params["eval.n_windows"] == str(cfg.eval.limit)
    assert params["eval.text_source"] == run.data.tags["text_source"]
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for d in ("eval", "quant") for a in client.list_artifacts(run_id, d)}
    assert {"config.yaml", "run.log", "eval/windows.npy", "eval/per_window.csv", "quant/encodings.csv",
            "quant/summary.txt"} <= artifacts
    windows = np.load(client.download_artifacts(run_id, "eval/windows.npy"))
    assert windows.shape == (cfg.eval.limit, cfg.eval.seq_len) and windows.dtype.kind == "i"
    import hashlib

    assert hashlib.sha256(windows.astype(np.int64).tobytes()).hexdigest() == run.data.tags["eval_windows_sha256"]
    _check_what_the_ui_shows(client, run, cfg)
    return run


def _check_what_the_ui_shows(client: MlflowClient, run, cfg):
    """the UI opens on the runs table; a run has a short readable name, a one-line result and its datasets."""
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "ppl_qdq" in experiment.tags["mlflow.note.content"]
    assert run.info.run_name.startswith(f"tiny · {cfg.quant.name} · RTN · ")
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith(f"ppl {run.data.metrics['ppl_qdq']:.1f} (") and "vs FP" in note and "min" in note
    inputs = {{t.key: t.value for t in d.tags}["mlflow.data.context"]: d.dataset
              for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"evaluation", "calibration"}
    source = run.data.tags["text_source"]
    assert inputs["evaluation"].name == f"{source}:test" and inputs["calibration"].name == f"{source}:calibration"
    assert inputs["evaluation"].digest == run.data.tags["eval_windows_sha256"][:16]
    assert inputs["calibration"].digest == run.data.tags["calibration_sha256"][:16]
    found = client.search_runs([run.info.experiment_id], f"dataset.digest = '{inputs['evaluation'].digest}'")
    assert run.info.run_id in {r.info.run_id for r in found}


def test_experiment_in_embedded_store(compose, store_uri):
    cfg = compose(TINY + ["quant=16a8w"])
    result = run_experiment(cfg)
    run = _check_run(MlflowClient(store_uri), result.run_id, cfg)
    assert run.data.metrics["ppl_fp"] == pytest.approx(result.metrics["ppl_fp"])
    log_text = mlflow.artifacts.load_text(f"runs:/{result.run_id}/run.log")
    assert "stage quantize" in log_text


def test_fp32_runs_only_fp_phase(compose, store_uri):
    result = run_experiment(compose(TINY + ["quant=fp32", "tracking.sweep=one_off"]))
    run = MlflowClient(store_uri).get_run(result.run_id)
    assert "ppl_fp" in run.data.metrics and "ppl_qdq" not in run.data.metrics
    assert run.data.tags["phases"] == "fp"
    # a single run named into a sweep is found by `qexp.report --sweep`, not only a multirun's children
    assert run.data.tags["qexp.sweep"] == "one_off" and "mlflow.parentRunId" not in run.data.tags


def test_second_run_hits_the_qdq_cache(compose, store_uri):
    cfg = compose(TINY + ["quant=8a8w", "observer=moving_average"])
    first, second = run_experiment(cfg), run_experiment(cfg)
    tags = [MlflowClient(store_uri).get_run(r.run_id).data.tags for r in (first, second)]
    assert tags[0]["qdq_cache_hit"] == "false" and tags[1]["qdq_cache_hit"] == "true"
    assert first.metrics["ppl_qdq"] == pytest.approx(second.metrics["ppl_qdq"], rel=1e-9)
    assert tags[0]["config_hash"] == tags[1]["config_hash"]


def test_failed_run_is_marked_failed(compose, store_uri, tmp_path):
    cfg = compose(["model=llama_checkpoint", f"model.checkpoint={tmp_path}/missing.pth",
                   f"model.params={tmp_path}/params.json", f"model.tokenizer={tmp_path}/tok.model",
                   "tracking.run_name=poisoned"])
    with pytest.raises(Exception, match="checkpoint not found"):
        run_experiment(cfg)
    client = MlflowClient(store_uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id],
                              "tags.mlflow.runName = 'poisoned'")
    assert runs and runs[0].info.status == "FAILED"
    assert "checkpoint not found" in runs[0].data.tags["error"]
    assert runs[0].data.tags["mlflow.note.content"].startswith("FAILED: ") and "checkpoint not found" in \
        runs[0].data.tags["mlflow.note.content"]
    assert "checkpoint not found" in mlflow.artifacts.load_text(f"runs:/{runs[0].info.run_id}/error.txt")


def test_experiment_in_real_server(compose, mlflow_server):
    cfg = compose(TINY + ["quant=8a8w", f"tracking.uri={mlflow_server}"])
    result = run_experiment(cfg)
    _check_run(MlflowClient(mlflow_server), result.run_id, cfg)


def test_env_var_selects_the_store(compose, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = compose(TINY + ["quant=fp32"], tracked=False)
    assert cfg.tracking.uri == mlflow_server
    result = run_experiment(cfg)
    assert MlflowClient(mlflow_server).get_run(result.run_id).info.status == "FINISHED"


def test_unreachable_server_fails_fast(compose):
    cfg = compose(TINY + [f"tracking.uri=http://127.0.0.1:{free_port()}"])
    start = time.time()
    with pytest.raises(TrackingError, match="unreachable"):
        run_experiment(cfg)
    assert time.time() - start < 30  # no minutes of retries (a bound on a failure path, not a speed target)


def test_window_longer_than_model_context(compose):
    """The tiny model was built for 1024 positions: a 2048-token window is refused in one line."""
    from qexp.core.errors import InputError

    cfg = compose(TINY + ["eval.seq_len=2048", "export.max_context_len=2048", "calibration.seq_len=64"])
    with pytest.raises(InputError, match="larger than the model's context"):
        run_experiment(cfg)


def test_credentials_never_reach_the_store_logs_or_outputs(mlflow_server, cache_dir, tmp_path):
    """A sweep against a server addressed with a password in its URI: the password appears in no param, tag,
    artifact, store file (the server's sqlite and artifact root are under tmp_path), terminal line or Hydra output
    file; the one file that holds the URI (the sweep file the jobs connect with) is readable by its owner only."""
    from helpers import REPO

    secret = "S3cr3tPassw0rd"
    uri = mlflow_server.replace("http://", f"http://alice:{secret}@")
    out = subprocess.run(
        [sys.executable, "-m", "qexp", "-m", *TINY, "eval.limit=2", "quant=fp32,16a8w", f"tracking.uri={uri}",
         "tracking.experiment=secrets", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO, env={**os.environ, "QEXP_CACHE_DIR": str(cache_dir)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert secret not in out.stdout + out.stderr
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    assert len(runs) == 3  # the parent and two jobs
    for run in runs:
        assert secret not in repr(run.data.params) + repr(run.data.tags), run.info.run_id
    assert any("alice:***@" in run.data.params.get("tracking.uri", "") for run in runs)
    holders = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert [p.name for p in holders] == ["qexp_sweep.json"], holders
    assert oct(holders[0].stat().st_mode & 0o777) == "0o600"


def test_secret_named_settings_and_uri_credentials_are_masked():
    from qexp.core.redact import redact, redact_text

    assert redact({"model": {"hf_token": "hf_abc", "path": "/m"}, "db_password": "pw", "n": 3}) == {
        "model": {"hf_token": "***", "path": "/m"}, "db_password": "***", "n": 3}
    assert redact_text("uri=https://bob:pw@host/x?api_key=k&page=2 user_token=t") == (
        "uri=https://bob:***@host/x?api_key=***&page=2 user_token=***")
    assert redact_text("sqlite:////home/me/mlruns.db") == "sqlite:////home/me/mlruns.db"
    assert redact_text("token=t HF_TOKEN=t model.access_token=t") == "token=*** HF_TOKEN=*** model.access_token=***"
    # token counts and tokenizer paths are settings, not secrets: a stored command must keep them
    kept = ("algorithm.qat.tokens=65536 backend.eval_tokens=2048 model.tokenizer=/m/tok.model "
            "eval.generation_tokens=32 qat(tokens=65536 lr=1e-4)")
    assert redact_text(kept) == kept
    assert redact({"tokenizer": "/m/tok.model", "eval_tokens": "2048", "token": "t"}) == {
        "tokenizer": "/m/tok.model", "eval_tokens": "2048", "token": "***"}


def test_the_embedded_store_and_the_cache_are_private(tmp_path):
    from qexp.cache import Cache
    from qexp.core.config import TrackingConfig
    from qexp.tracking.store import Tracker

    Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path / 'new.db'}", experiment="private")).connect()
    assert oct((tmp_path / "new.db").stat().st_mode & 0o777) == "0o600"
    Cache(tmp_path / "cache").get_or_build("kind", "key", lambda tmp: None)
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"


def test_a_dataset_logged_by_two_jobs_at_once_is_linked_not_failed(store_uri, monkeypatch):
    """Two jobs logging the same dataset at once: MLflow's store inserts it twice and the second insert fails on
    its unique constraint (seen with two sweeps on a tracking server). The job must link the existing dataset.
    The race itself is what test_reliability's concurrent sweeps hit; here MLflow's first answer is replayed."""
    import mlflow.exceptions

    from qexp.core.config import TrackingConfig
    from qexp.tracking.store import Tracker

    real, calls = MlflowClient.log_inputs, []

    def racing_log_inputs(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise mlflow.exceptions.MlflowException("BAD_REQUEST: (sqlite3.IntegrityError) UNIQUE constraint failed: "
                                                    "datasets.experiment_id, datasets.name, datasets.digest")
        return real(self, *args, **kwargs)

    tracker = Tracker(TrackingConfig(uri=store_uri, experiment="datasets_race"))
    run_id = tracker.start("race", {})
    monkeypatch.setattr(MlflowClient, "log_inputs", racing_log_inputs)
    try:
        Tracker.dataset(np.arange(8).reshape(2, 4), "text:test", "ab" * 32, "/dev/null", "evaluation", {})
    finally:
        tracker.finish()
    run = MlflowClient(store_uri).get_run(run_id)
    assert len(calls) == 2 and [d.dataset.name for d in run.inputs.dataset_inputs] == ["text:test"]


def test_a_sweep_does_not_resume_from_a_run_its_config_is_refused_for_now(compose, store_uri, tmp_path):
    """A config that finished before a check that now refuses it (e.g. an HTP program with mixed KV cache widths,
    which computed garbage) is not skipped on a sweep's resume: the job runs again and fails, in a FAILED run that
    says why. A config still valid is skipped as before."""
    from qexp.core.errors import ConfigError
    from qexp.core.provenance import config_hash
    from qexp.tracking.store import Tracker
    from qexp.tracking.sweep import SweepJob

    def finished_before(cfg):  # a FINISHED run of this config, as an earlier version of qexp left it
        tracker = Tracker(cfg.tracking)
        tracker.start("made before the check", {"config_hash": config_hash(cfg)})
        tracker.finish()

    refused = compose(TINY + ["backend=htp", "tracking.experiment=resume_refused", "quant=16a8w",
                              "quant.overrides=[{pattern: 'layers\\.\\d+\\.attention\\.wv_conv', scheme: 8a8w}]"])
    finished_before(refused)
    with pytest.raises(ConfigError, match="one KV cache type"):
        run_experiment(refused, SweepJob("resume", None, 0, tmp_path / "job0"))
    client = MlflowClient(store_uri)
    runs = client.search_runs([client.get_experiment_by_name("resume_refused").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    assert "one KV cache type" in next(r for r in runs if r.info.status == "FAILED").data.tags["error"]

    valid = compose(TINY + ["quant=fp32", "tracking.experiment=resume_valid"])
    finished_before(valid)
    assert run_experiment(valid, SweepJob("resume", None, 0, tmp_path / "job1")).skipped


def test_a_sweep_does_not_resume_from_an_older_htp_exact_model(compose, store_uri, tmp_path):
    """An eval.htp_exact run computed by an older model of HTP's arithmetic (its htp_exact_model tag differs, or is
    missing as on runs before the tag) is not skipped on a sweep's resume: its QDQ numbers are not this code's. One
    computed by the current model is skipped, and so is a fake-quant run whatever its tags."""
    from qexp.core.provenance import config_hash
    from qexp.quant.htp_arithmetic_pass import MODELLED_OPS
    from qexp.tracking.store import Tracker
    from qexp.tracking.sweep import SweepJob

    def finished_before(cfg, tags):
        tracker = Tracker(cfg.tracking)
        tracker.start("made by an earlier qexp", {"config_hash": config_hash(cfg), **tags})
        tracker.finish()

    for name, htp_exact, tags, skipped in [
            ("older", "true", {"qdq_arithmetic": "htp_exact", "htp_exact_model": "conv_accumulator_floor"}, False),
            ("untagged", "true", {"qdq_arithmetic": "htp_exact"}, False),
            ("current", "true", {"qdq_arithmetic": "htp_exact", "htp_exact_model": MODELLED_OPS}, True),
            ("fake_quant", "false", {"qdq_arithmetic": "fake_quant"}, True)]:
        cfg = compose(TINY + ["quant=16a8w", f"eval.htp_exact={htp_exact}", f"tracking.experiment=resume_{name}"])
        finished_before(cfg, tags)
        result = run_experiment(cfg, SweepJob("resume", None, 0, tmp_path / name))
        assert result.skipped == skipped, name
        if not skipped:
            assert MlflowClient(store_uri).get_run(result.run_id).data.tags["htp_exact_model"] == MODELLED_OPS


def test_the_ui_on_a_store_that_does_not_exist_yet_says_so_and_creates_nothing(tmp_path):
    store = tmp_path / "none.db"
    out = subprocess.run([sys.executable, "-m", "qexp.ui", "--tracking-uri", f"sqlite:///{store}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"qexp.ui: no qexp store at {store} yet (`make run` makes one, or pass --tracking-uri)"
    assert not store.exists() and not out.stderr


def test_a_store_that_is_away_is_told_from_one_that_refuses(monkeypatch):
    """What a run waits for (no connection, a timeout, HTTP 5xx/408/429) and what it reports at once (a refused
    login or permission, a bad value): the errors MLflow's client raises in each case."""
    import requests
    from mlflow.exceptions import MlflowException, RestException

    from qexp.tracking.writer import store_is_away

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(MlflowException) as closed:  # a real refused connection, through MLflow's client
        MlflowClient(f"http://127.0.0.1:{free_port()}").set_tag("0" * 32, "k", "v")
    closed = closed.value
    away = [closed, requests.ConnectionError("reset"), requests.Timeout("slow"),
            RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "PostgreSQL restarting"}),
            MlflowException("API request to http://h/api/2.0/mlflow/runs/log-batch failed with error code 503 != 200")]
    refused = [RestException({"error_code": "PERMISSION_DENIED", "message": "no edit"}),
               RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "param changed"}),
               MlflowException("API request to http://h/api/2.0/mlflow/runs/create failed with error code 401 != 200"),
               ValueError("a bug")]
    assert [store_is_away(e) for e in away] == [True] * len(away)
    assert [store_is_away(e) for e in refused] == [False] * len(refused)


def test_the_sweeps_summary_waits_for_a_store_that_is_away_and_not_for_one_that_refuses(monkeypatch):
    """patiently(): the errors a closed port gives (real ones, through MLflow's client) are waited out with backoff
    until the store answers; a refusal raises at once; an outage longer than the limit raises its last error."""
    from mlflow.exceptions import MlflowException, RestException

    from qexp.tracking.writer import patiently

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    closed = MlflowClient(f"http://127.0.0.1:{free_port()}")
    calls, slept = [], []

    def store_back_on_third_call():
        calls.append(1)
        if len(calls) < 3:
            closed.set_tag("0" * 32, "k", "v")  # raises: nothing listens there
        return "written"

    assert patiently("http://x", 60, store_back_on_third_call, sleep=slept.append) == "written"
    assert len(calls) == 3 and slept == [1.0, 2.0]
    with pytest.raises(MlflowException):
        patiently("http://x", 0.5, lambda: closed.set_tag("0" * 32, "k", "v"), sleep=lambda s: None)
    refused = []
    with pytest.raises(RestException):
        patiently("http://x", 60, lambda: refused.append(1) or (_ for _ in ()).throw(
            RestException({"error_code": "PERMISSION_DENIED", "message": "no"})), sleep=slept.append)
    assert refused == [1]
