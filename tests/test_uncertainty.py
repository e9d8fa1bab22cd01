"""95% intervals of perplexity ratios (paired bootstrap, qexp/eval/uncertainty.py): their definition, their coverage
on data with a known answer, and their place in runs and reports."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from helpers import TINY
from qexp.eval.uncertainty import BLOCK, ppl_ratio_interval, windows_needed
from qexp.report.table import formatted


def _pair(rng, windows=8, tokens=255, shift=-0.02, noise=0.3):
    """Reference log-likelihoods with window-level difficulty, and a test phase worse by `shift` nats on average."""
    reference = rng.normal(-3.0, 1.0, size=(windows, tokens)) + rng.normal(0, 0.5, size=(windows, 1))
    test = reference + shift + rng.normal(0, noise, size=reference.shape)
    return test, reference


def test_identical_phases_give_a_zero_interval():
    test, reference = _pair(np.random.default_rng(0))
    interval = ppl_ratio_interval(reference, reference)
    assert interval["ci_low"] == interval["ci_high"] == 0.0 and interval["ci_units"] == 8


def test_the_interval_holds_the_estimate_and_is_seeded():
    test, reference = _pair(np.random.default_rng(1))
    point = np.exp((reference.sum() - test.sum()) / reference.size) - 1
    interval = ppl_ratio_interval(test, reference)
    assert interval["ci_low"] < point < interval["ci_high"] and interval["ci_low"] > 0  # 2% worse, clearly
    assert ppl_ratio_interval(test, reference) == interval


def test_coverage_on_data_with_a_known_answer():
    """Windows drawn from one distribution: the true ratio is exp(-shift) - 1. About 95% of intervals must hold it
    (a paired bootstrap over 8 windows under-covers a little; it must not be far off)."""
    rng = np.random.default_rng(2)
    shift, hits, trials = -0.01, 0, 200
    truth = np.exp(-shift) - 1
    for _ in range(trials):
        test, reference = _pair(rng, windows=16, tokens=64, shift=shift, noise=0.3)
        interval = ppl_ratio_interval(test, reference)
        hits += interval["ci_low"] <= truth <= interval["ci_high"]
    assert 0.85 <= hits / trials <= 0.99, hits / trials


def test_one_window_is_resampled_in_token_blocks():
    test, reference = _pair(np.random.default_rng(3), windows=1, tokens=255)
    interval = ppl_ratio_interval(test, reference)
    assert interval["ci_units"] == 255 // BLOCK and interval["ci_low"] < interval["ci_high"]


def test_windows_needed_shrinks_with_the_difference_to_resolve():
    test, reference = _pair(np.random.default_rng(4), windows=8)
    sums = test.sum(axis=1), reference.sum(axis=1)
    assert windows_needed(*sums, 255, 0.001) > windows_needed(*sums, 255, 0.01) >= 1
    # the rule: 4x the windows halve the interval
    wide = _pair(np.random.default_rng(5), windows=32)
    n8 = windows_needed(*sums, 255, 0.005)
    n32 = windows_needed(wide[0].sum(axis=1), wide[1].sum(axis=1), 255, 0.005)
    assert 0.5 < n8 / n32 < 2  # the same population: the same answer from 8 or 32 windows, within sampling noise


def test_report_cells_show_the_interval_and_mark_noise():
    table = pd.DataFrame({"Δ vs FP": [0.897, 0.004, np.nan]})
    table.attrs["ci"] = {"Δ vs FP": (pd.Series([0.841, -0.003, np.nan]), pd.Series([0.956, 0.011, np.nan]))}
    assert list(formatted(table)["Δ vs FP"]) == ["+89.7% [+84.1, +95.6]", "+0.4% [-0.3, +1.1] ~", "-"]


def test_a_run_logs_the_interval_of_each_comparison(compose):
    from qexp.pipeline import run_experiment

    metrics = run_experiment(compose(TINY + ["quant=16a4w"])).metrics
    low, high = metrics["ppl_qdq_vs_fp_ci_low"], metrics["ppl_qdq_vs_fp_ci_high"]
    assert low <= metrics["ppl_qdq_vs_fp"] <= high
    assert metrics["ppl_qdq_vs_fp_ci_units"] == 3  # 3 windows of 63 tokens: too short for blocks, so windows


def test_report_pairs_runs_on_the_same_windows(compose, store_uri, tmp_path, capsys):
    """`--paired-vs algorithm=RTN`: the rotated run against the round-to-nearest run of the same scheme, with an
    interval; `--windows-needed 1` from each run's per-window log-likelihoods."""
    import mlflow

    from qexp.pipeline import run_experiment
    from qexp.report import main as report

    # a second round-to-nearest run that differs only by an override: another baseline, not the rotated run's
    # (the recipe's 8-bit lm head kept, so the lm head grid is the same)
    override = ("quant.overrides=[{pattern: 'output\\.conv', scheme: 16a8w}, "
                "{pattern: 'layers\\.0\\.feed_forward\\.w2_conv', scheme: 16a8w}]")
    ppl = {}
    for algorithm, extra in (("[]", []), ("[rotation]", []), ("[]", [override])):
        cfg = compose(TINY + ["quant=16a4w", f"algorithm={algorithm}", *extra])
        cfg.tracking.experiment = "paired"
        ppl[algorithm, bool(extra)] = run_experiment(cfg).metrics["ppl_qdq"]
    assert ppl["[]", True] != ppl["[]", False]
    mlflow.set_tracking_uri(store_uri)
    code = report(["--experiment", "paired", "--columns", "scheme,algorithm,ppl_qdq,delta_vs_fp", "--paired-vs",
                   "algorithm=RTN", "--windows-needed", "1", "--out-dir", str(tmp_path), "--tracking-uri", store_uri])
    out = capsys.readouterr().out
    assert code == 0, out
    data = pd.read_csv(tmp_path / "paired.csv")
    rotated = data[data["algorithm"] == "rotation"].iloc[0]
    assert rotated["Δ vs RTN ci_low"] <= rotated["Δ vs RTN"] <= rotated["Δ vs RTN ci_high"]
    assert rotated["Δ vs RTN"] == pytest.approx(ppl["[rotation]", False] / ppl["[]", False] - 1, rel=1e-9)
    assert data.loc[data["algorithm"] == "RTN", "Δ vs RTN"].isna().all()  # the baseline is not paired with itself
    assert (data["windows for ±1%"] >= 1).all()
    assert "Δ vs RTN" in out and "[" in out


def test_pairing_against_a_recipe_lets_the_recipe_differ():
    """`--paired-vs params.quant.name=recipe_llama3_2_1b` pairs recipes (overrides, grids may differ); an algorithm
    pairing keeps them equal."""
    from qexp.report.paired import IDENTITY, QUANT_IDENTITY, pairing_identity

    recipe = pairing_identity("params.quant.name", IDENTITY)
    assert not set(QUANT_IDENTITY) & set(recipe) and "tags.eval_windows_sha256" in recipe
    assert set(QUANT_IDENTITY) <= set(pairing_identity("algorithm", IDENTITY))


def test_windows_needed_for_the_deployed_program_against_its_qdq_program(monkeypatch):
    """`--windows-needed` adds the deployed-vs-QDQ figure from the windows the deployed phase scored (NaN after them
    in eval/per_window.csv); a run without a deployed phase on whole windows gets '-'."""
    import importlib

    from qexp.report.base import Report

    paired = importlib.import_module("qexp.report.paired")
    rng = np.random.default_rng(1)
    fp = -150 + rng.normal(0, 5, 16)
    qdq = fp - 2 + rng.normal(0, 1, 16)
    close, loose = np.full(16, np.nan), np.full(16, np.nan)
    close[:8] = qdq[:8] + rng.normal(0, 0.2, 8)  # a deployed program that tracks its QDQ program closely
    loose[:8] = qdq[:8] + rng.normal(0, 2.0, 8)  # one that does not
    files = {"close": pd.DataFrame({"ll_fp": fp, "ll_qdq": qdq, "ll_deployed": close}),
             "loose": pd.DataFrame({"ll_fp": fp, "ll_qdq": qdq, "ll_deployed": loose}),
             "qdq_only": pd.DataFrame({"ll_fp": fp, "ll_qdq": qdq})}
    monkeypatch.setattr(paired, "per_window", lambda run_id: files[run_id])
    runs = pd.DataFrame({"run_id": list(files), "params.eval.window_len": ["64"] * 3})
    report = Report(table=pd.DataFrame(index=range(3)), data=runs.copy())
    paired.add_windows_needed(report, runs, 0.01)
    needed = dict(zip(runs["run_id"], report.data["windows for ±1% deployed vs QDQ"]))
    assert 1 <= needed["close"] < needed["loose"] and needed["qdq_only"] == -1
    assert list(report.table["windows for ±1% deployed vs QDQ"])[2] == "-"
