"""`python -m qexp.report --compare RUN_A RUN_B` on a small real store: three tiny runs (16a8w, 16a4w, and 16a4w on
one more window), plus two runs logged by hand for what tiny runs cannot produce (an old run's HTP-specific names, a
deployed phase on another target, a FAILED run). One store for every test: tiny runs take ~10 s each."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import TINY

EXPERIMENT = "compare"


@pytest.fixture(scope="module")
def store(compose, tmp_path_factory):
    """(tracking URI, {label: run id}) of the tiny runs, in a store of this module's own."""
    from qexp.pipeline import run_experiment

    uri = f"sqlite:///{tmp_path_factory.mktemp('compare') / 'mlruns.db'}"
    configs = {"16a8w": ["quant=16a8w"], "16a4w": ["quant=16a4w"], "16a4w_4_windows": ["quant=16a4w", "eval.limit=4"]}
    ids = {}
    for label, overrides in configs.items():
        cfg = compose(TINY + overrides)
        cfg.tracking.uri, cfg.tracking.experiment = uri, EXPERIMENT
        ids[label] = run_experiment(cfg).run_id
    return uri, ids


@pytest.fixture(scope="module")
def synthetic(store):
    """An HTP run logged under the old names (ppl_htp, backend.kind) and a FAILED XNNPACK run on this CPU."""
    import mlflow

    uri, _ = store
    client = mlflow.tracking.MlflowClient(uri)
    experiment = client.create_experiment("synthetic")
    common = {"params": {"eval.window_len": "256", "eval.n_windows": "8", "quant.name": "16a8w"},
              "tags": {"text_sha256": "abc"}, "metrics": {"ppl_fp": 24.9}}
    runs = {
        "old_htp": ({"backend.kind": "htp", "backend.name": "htp"}, {"target": "x86_emulator"},
                    {"ppl_htp": 23.1, "ppl_htp_vs_qdq": 0.004, "decode_tok_s": 0.2}, "FINISHED"),
        "xnnpack": ({"backend.name": "xnnpack"}, {"target": "cpu", "error": "RuntimeError: boom"},
                    {"ppl_deployed": 27.0, "ppl_deployed_vs_qdq": 0.01, "decode_tok_s": 60.0}, "FAILED"),
    }
    ids = {}
    for label, (params, tags, metrics, status) in runs.items():
        run = client.create_run(experiment, run_name=label, tags={**common["tags"], **tags})
        for key, value in {**common["params"], **params}.items():
            client.log_param(run.info.run_id, key, value)
        for key, value in {**common["metrics"], **metrics}.items():
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id, status)
        ids[label] = run.info.run_id
    return uri, ids


def _metric(comparison, name):
    rows = [row for row in comparison.metrics if row.name == name]
    assert len(rows) == 1, [row.name for row in comparison.metrics]
    return rows[0]


def test_compare_shows_differing_params_and_metrics_with_a_paired_interval(store):
    import mlflow

    from qexp.report.compare_render import render
    from qexp.report.compare_runs import compare_runs

    uri, ids = store
    comparison = compare_runs(ids["16a8w"], ids["16a4w"], uri)
    differ = {key: (a, b) for key, a, b in comparison.params_differ}
    assert differ["quant.name"] == ("16a8w", "16a4w") and differ["quant.scheme"] == ("16a8w", "16a4w")
    assert not any(key.startswith("tracking.") for key in differ)  # bookkeeping is not a difference
    assert comparison.params_equal > 20 and comparison.not_comparable is None and comparison.timing_differs is None

    client = mlflow.tracking.MlflowClient(uri)
    expected = [client.get_run(ids[label]).data.metrics["ppl_qdq"] for label in ("16a8w", "16a4w")]
    ppl_qdq = _metric(comparison, "ppl_qdq")
    assert (ppl_qdq.a, ppl_qdq.b) == tuple(expected)
    ratio = expected[1] / expected[0] - 1
    low, high = ppl_qdq.paired
    assert low <= ratio <= high  # the paired interval of B/A - 1 over the 3 shared windows holds the estimate
    assert _metric(comparison, "ppl_fp").paired == (0.0, 0.0)  # the same FP model on the same windows
    assert [row.name for row in comparison.metrics[:2]] == ["ppl_fp", "ppl_qdq"]  # perplexities first

    text = render(comparison)
    line = next(line for line in text.splitlines() if line.strip().startswith("ppl_qdq "))
    assert f"{expected[1] - expected[0]:+.4g}" in line and f"{ratio:+.1%} [{100 * low:+.1f}, {100 * high:+.1f}]" in line
    assert "paired bootstrap over the 3 windows" in text and "NOT COMPARABLE" not in text
    assert text.count("FINISHED") == 2 and len(text.splitlines()) < 60


def test_compare_flags_runs_on_other_windows(store):
    from qexp.report.compare_render import render
    from qexp.report.compare_runs import compare_runs

    uri, ids = store
    comparison = compare_runs(ids["16a4w"], ids["16a4w_4_windows"], uri)
    assert comparison.not_comparable == "window count 3 vs 4"
    assert ("eval.n_windows", "3", "4") in comparison.params_differ
    ppl_qdq = _metric(comparison, "ppl_qdq")
    assert ppl_qdq.flag == "NOT COMPARABLE" and np.isnan(ppl_qdq.paired).all()  # no interval across windows
    text = render(comparison)
    assert "NOT COMPARABLE: different text/window length/window count/CPU (window count 3 vs 4)" in text
    assert "paired bootstrap" not in text


def test_compare_flags_runs_on_another_cpu(store):
    """an Intel and an AMD host calibrate the same config to different programs, so two runs on different CPU
    models get no paired interval (the tag is restored afterwards: the store is shared by this module's tests)."""
    import mlflow

    from qexp.report.compare_runs import compare_runs

    uri, ids = store
    client = mlflow.tracking.MlflowClient(uri)
    own = client.get_run(ids["16a8w"]).data.tags["cpu"]
    client.set_tag(ids["16a8w"], "cpu", "AMD EPYC 9B14")
    try:
        comparison = compare_runs(ids["16a8w"], ids["16a4w"], uri)
    finally:
        client.set_tag(ids["16a8w"], "cpu", own)
    assert comparison.not_comparable == f"CPU AMD EPYC 9B14 vs {own}"
    ppl_qdq = _metric(comparison, "ppl_qdq")
    assert ppl_qdq.flag == "NOT COMPARABLE" and np.isnan(ppl_qdq.paired).all()


def test_compare_lines_up_legacy_names_and_flags_targets(synthetic):
    from qexp.report.compare_render import render
    from qexp.report.compare_runs import compare_runs

    uri, ids = synthetic
    comparison = compare_runs(ids["old_htp"], ids["xnnpack"], uri)
    deployed = _metric(comparison, "ppl_deployed")  # the old run's ppl_htp
    assert (deployed.a, deployed.b) == (23.1, 27.0)
    assert {row.name for row in comparison.metrics}.isdisjoint({"ppl_htp", "ppl_htp_vs_qdq"})
    assert ("backend.name", "htp", "xnnpack") in comparison.params_differ
    assert not any(key == "backend.kind" for key, _, _ in comparison.params_differ)
    assert "target x86_emulator vs cpu" in comparison.timing_differs and "not phone speed" in comparison.timing_differs
    assert _metric(comparison, "decode_tok_s").flag and not _metric(comparison, "ppl_fp").flag
    assert comparison.b.warning.startswith("FAILED: RuntimeError: boom") and comparison.a.warning is None
    text = render(comparison)
    assert "TIMINGS NOT COMPARABLE" in text and "! FAILED" in text and "no eval/per_window.csv" in text
    relative = next(line for line in text.splitlines() if "ppl_deployed_vs_qdq" in line)
    assert "+0.4%" in relative and "+1.0%" in relative and "+0.60 pp" in relative


def test_cli_compare_by_prefix_and_name_and_refuses_unknown_or_ambiguous(store, tmp_path, capsys):
    import mlflow

    from qexp.report import main as report

    uri, ids = store
    base = ["--tracking-uri", uri, "--out-dir", str(tmp_path)]
    assert report(["--compare", ids["16a8w"][:8], ids["16a4w"]] + base) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"A  {ids['16a8w']}") and "quant.name" in out and "ppl_qdq" in out
    assert not list(tmp_path.iterdir())  # a comparison writes no table or plots

    unique_name = mlflow.tracking.MlflowClient(uri).get_run(ids["16a8w"]).info.run_name
    assert report(["--compare", unique_name, ids["16a4w"], "--experiment", EXPERIMENT] + base) == 0
    assert f"A  {ids['16a8w']}" in capsys.readouterr().out

    for refs, error in [(["0123456789ab", ids["16a4w"]], "no run '0123456789ab'"),
                        ([ids["16a8w"], "nope"], "no run 'nope'"),
                        ([ids["16a8w"], ids["16a4w"], "--experiment", "missing"], "no MLflow experiment 'missing'")]:
        assert report(["--compare"] + refs + base) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"qexp.report: error: {error}") and len(captured.err.splitlines()) == 1
        assert captured.out == ""

    # the two 16a4w runs share a name: the error lists both ids
    shared_name = mlflow.tracking.MlflowClient(uri).get_run(ids["16a4w"]).info.run_name
    assert report(["--compare", shared_name, ids["16a8w"]] + base) == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and ids["16a4w"][:8] in err and ids["16a4w_4_windows"][:8] in err


def test_deployed_phases_are_paired_on_the_windows_both_scored(monkeypatch):
    """A deployed phase that scored the first windows only (NaN after them in eval/per_window.csv) is paired over
    those windows; two deployed phases on different windows get no interval, and the note says so."""
    import importlib

    import pandas as pd

    module = importlib.import_module("qexp.report.compare_runs")  # the module (qexp.report exports the function)

    rng = np.random.default_rng(0)
    base = -200 + rng.normal(0, 5, 6)

    def frame(deployed_windows, shift):
        deployed = np.full(6, np.nan)
        deployed[:deployed_windows] = base[:deployed_windows] - shift + rng.normal(0, 0.5, deployed_windows)
        return pd.DataFrame({"window": np.arange(6), "ll_fp": base, "ll_qdq": base - 1.0, "ll_deployed": deployed})

    files = {"a": frame(3, 1.0), "b": frame(3, 3.0), "c": frame(5, 3.0)}
    monkeypatch.setattr(module, "window_loglikelihoods", lambda run_id: files[run_id])
    info = pd.DataFrame({"params.eval.window_len": ["64", "64"], "tags.eval_windows_sha256": ["w", "w"]})

    rows = [module.MetricRow(f"ppl_{p}", 1.0, 1.0) for p in ("fp", "qdq", "deployed")]
    note = module._add_paired_intervals(info, rows, ["a", "b"])
    low, high = rows[2].paired
    assert 0 < low < high  # b's deployed phase is 2 nats per window worse on the 3 windows both scored
    assert "ppl_fp, ppl_qdq: 6; ppl_deployed: 3" in note

    rows = [module.MetricRow(f"ppl_{p}", 1.0, 1.0) for p in ("fp", "qdq", "deployed")]
    note = module._add_paired_intervals(info, rows, ["a", "c"])
    assert np.isnan(rows[2].paired).all() and not np.isnan(rows[1].paired).any()
    assert "No interval on ppl_deployed: the runs' deployed phases scored different windows" in note
