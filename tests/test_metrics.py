"""The metric catalog (qexp/core/metrics.py): what the report, the UI, the search and the docs read about metrics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from qexp.core import metrics
from qexp.core.metrics import CATALOG, HIGHER, LOWER, UnlistedMetricError, better, check, header, lookup

ROOT = Path(__file__).resolve().parents[1]


def test_an_unlisted_metric_is_refused_under_the_suites_check_and_warned_about_otherwise(monkeypatch, caplog):
    assert lookup("ppl_qdq") and lookup("time_calibrate_s") and lookup("ddr_read_total_bytes_kv_forward")
    with pytest.raises(UnlistedMetricError, match="made_up_score.*Adding a metric"):
        check(["ppl_qdq", "made_up_score"])  # the suite sets QEXP_CHECK_METRICS=1 (tests/conftest.py)
    monkeypatch.delenv("QEXP_CHECK_METRICS")
    with caplog.at_level(logging.WARNING, logger="qexp"):
        check(["made_up_score"])
    assert "made_up_score" in caplog.text


def test_a_run_that_logs_an_unlisted_metric_fails(compose, monkeypatch):
    """The check sits where every metric goes to the store: a run's metrics, whatever stage adds them."""
    from qexp import stages
    from qexp.pipeline import run_experiment
    from helpers import TINY

    original = stages.STAGE_FUNCTIONS["load"]

    def load_and_add(state):
        original(state)
        state.metrics["made_up_score"] = 1.0

    monkeypatch.setitem(stages.STAGE_FUNCTIONS, "load", load_and_add)
    with pytest.raises(UnlistedMetricError, match="made_up_score"):
        run_experiment(compose(TINY + ["tracking.experiment=metric_catalog"]))


def test_entries_are_distinct_and_their_headers_fill_in():
    names = [metric.name for metric in CATALOG]
    assert len(names) == len(set(names))
    for metric in CATALOG:
        assert metric.better in (LOWER, HIGHER, "") and metric.label in ("", metrics.ESTIMATE, metrics.MEASURED)
    assert header("ppl_qdq") == "PPL QDQ" and header("ppl_deployed_vs_qdq") == "Δ deployed vs QDQ"
    assert header("time_calibration_data_s") == "calibration data s"
    assert header("ddr_spill_bytes_prefill_forward") == "DDR spill_bytes prefill_forward"
    assert better("decode_tok_s_est") == HIGHER and better("ppl_fp") == LOWER
    assert lookup("decode_tok_s_est").label == metrics.ESTIMATE and lookup("decode_tok_s").label == metrics.MEASURED
    assert lookup("ppl_qdq_sub").name == "ppl_{phase}_sub" and lookup("task.arc_easy.acc_qdq").name.startswith("task.")


def test_every_metric_the_product_names_is_in_the_catalog():
    """The report's columns, the UI's runs view, the search's objectives and the leaderboard's figures."""
    from qexp.core.search_config import SEARCH_OBJECTIVES
    from qexp.report.columns import COLUMNS, CSV_METRICS, EXTRA_COLUMNS
    from qexp.core.search_config import OBJECTIVE_METRICS as SEARCH_COLUMNS
    from qexp.tracking.ui_view import TABLE_METRICS, view_state

    named = [source.split(".", 1)[1] for source, _ in {**COLUMNS, **EXTRA_COLUMNS}.values()
             if source.startswith("metrics.")]
    named += list(CSV_METRICS) + list(TABLE_METRICS) + list(SEARCH_COLUMNS.values())
    named += [chart["metricKey"] for chart in view_state()["compareRunCharts"] if "metricKey" in chart]
    assert [name for name in named if lookup(name) is None] == []
    for objective, direction in SEARCH_OBJECTIVES.items():
        assert better(SEARCH_COLUMNS[objective]) == {"minimize": LOWER, "maximize": HIGHER}[direction]


def test_the_docs_page_is_the_catalog():
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert metrics.markdown() in page, "regenerate the table: python -m qexp.core.metrics (docs/metrics.md)"


def test_task_metrics_find_their_own_family():
    """A task's paired difference, its interval and its plain score each match their own entry (first match wins)."""
    assert lookup("task.my-task.acc_qdq_vs_fp").name == "task.{task}.{score}_{test}_vs_{ref}"
    assert lookup("task.my-task.acc_norm_deployed_vs_fp_ci_low").name.endswith("_ci_low")
    assert lookup("task.arc_easy.acc_norm_qdq").name == "task.{task}.{score}_{phase}"
    assert header("task.arc_easy.acc_norm_qdq") == "arc_easy acc_norm QDQ"
    assert lookup("recipe_1500_bits").name == "recipe_{budget}_bits"
    assert lookup("kv_update_us_per_token").label == metrics.MEASURED  # the emulator bench's KV updates (runner.py)
