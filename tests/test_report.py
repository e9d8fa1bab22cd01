"""The report on synthetic runs: today's backend-agnostic names, the legacy names of an existing store, the
comparability refusal, results/ output and the parent-run artifacts (a small real MLflow store, no sweep).
The report over real Hydra multiruns is in test_sweep.py."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

COMMON = {"params.model.name": "smollm2_135m", "tags.text_sha256": "abc", "params.eval.window_len": "256",
          "params.eval.n_windows": "8", "params.eval.text_source": "gensim", "metrics.ppl_fp": 24.9,
          "params.observer.name": "minmax", "params.calibration.name": "wikitext",
          "params.calibration.limit": "8", "params.calibration.seq_len": "256"}
# today's names: an HTP run on the emulator (QDQ phase + deployed phase on one window), an XNNPACK run on this CPU
# (deployed phase on all windows), a PyTorch-only run
HTP = {**COMMON, "run_id": "a", "tags.config_hash": "1", "params.backend.name": "htp", "params.quant.name": "16a8w",
       "params.quant.scheme": "16a8w", "tags.scheme": "16a8w", "params.backend.kv_update": "smart_mask",
       "params.backend.soc": "SM8650", "tags.target": "x86_emulator", "tags.deployed_phase": "htp",
       "metrics.ppl_qdq": 25.5, "metrics.ppl_qdq_vs_fp": 0.024, "metrics.ppl_deployed": 23.1,
       "metrics.ppl_deployed_vs_qdq": 0.004, "metrics.top1_agreement_deployed_vs_qdq": 0.95,
       "metrics.ppl_fp_sub": 22.5, "metrics.ppl_qdq_sub": 23.0, "metrics.deployed_eval_tokens": 255,
       "metrics.deployed_eval_windows": 1, "metrics.decode_tok_s": 0.2, "metrics.ttft_ms": 6000.0,
       "metrics.pte_bytes": 393e6, "metrics.weights_mb": 150.0}
XNNPACK = {**COMMON, "run_id": "b", "tags.config_hash": "2", "params.backend.name": "xnnpack",
           "params.quant.name": "fp32", "params.quant.scheme": "fp32", "tags.scheme": "8da4w", "tags.target": "cpu",
           "tags.deployed_phase": "xnnpack",
           "metrics.ppl_deployed": 27.0, "metrics.ppl_deployed_vs_fp": 0.084, "metrics.deployed_eval_tokens": 2040,
           "metrics.deployed_eval_windows": 8, "metrics.decode_tok_s": 60.0, "metrics.ttft_ms": 40.0,
           "metrics.pte_bytes": 120e6, "metrics.weights_mb": 540.0}
PYTORCH = {**COMMON, "run_id": "c", "tags.config_hash": "3", "params.backend.name": "none",
           "params.quant.name": "16a4w", "params.quant.scheme": "16a4w", "tags.scheme": "16a4w",
           "metrics.ppl_qdq": 30.0, "metrics.ppl_qdq_vs_fp": 0.2, "metrics.weights_mb": 100.0}

# The same three runs as the old code logged them: HTP-specific metric names, backend.kind, no scheme tag, and the
# whole (flat) backend and kv config groups on every run whatever its backend.
OLD_COMMON = {**COMMON, "params.kv.name": "smart_mask", "params.backend.soc": "SM8650",
              "params.backend.qmode": "8da4w", "params.backend.model_mode": "hybrid"}
OLD_HTP = {**OLD_COMMON, "run_id": "a", "tags.config_hash": "1", "params.backend.kind": "htp",
           "params.backend.name": "htp", "params.quant.name": "16a8w", "params.quant.scheme": "16a8w",
           "tags.target": "x86_emulator", "tags.kv_update": "smart_mask", "tags.htp_soc": "SM8650",
           "tags.htp_eval_path": "prefill", "metrics.ppl_qdq": 25.5, "metrics.ppl_qdq_vs_fp": 0.024,
           "metrics.logits_sqnr_db_qdq": 30.0, "metrics.ppl_htp": 23.1, "metrics.ppl_htp_vs_qdq": 0.004,
           "metrics.top1_agreement_htp_vs_qdq": 0.95, "metrics.ppl_fp_sub": 22.5, "metrics.ppl_qdq_sub": 23.0,
           "metrics.htp_eval_tokens": 255, "metrics.htp_eval_windows": 1, "metrics.decode_tok_s": 0.2,
           "metrics.ttft_ms": 6000.0, "metrics.pte_bytes": 393e6, "metrics.weights_mb": 150.0}
OLD_XNNPACK = {**OLD_COMMON, "run_id": "b", "tags.config_hash": "2", "params.backend.kind": "xnnpack",
               "params.backend.name": "xnnpack", "params.quant.name": "fp32", "params.quant.scheme": "fp32",
               "tags.target": "cpu", "metrics.ppl_deployed": 27.0, "metrics.ppl_deployed_vs_fp": 0.084,
               "metrics.logits_sqnr_db_deployed": 25.0, "metrics.decode_tok_s": 60.0, "metrics.ttft_ms": 40.0,
               "metrics.pte_bytes": 120e6, "metrics.weights_mb": 540.0}
OLD_PYTORCH = {**OLD_COMMON, "run_id": "c", "tags.config_hash": "3", "params.backend.kind": "none",
               "params.backend.name": "none", "params.quant.name": "16a4w", "params.quant.scheme": "16a4w",
               "metrics.ppl_qdq": 30.0, "metrics.ppl_qdq_vs_fp": 0.2, "metrics.weights_mb": 100.0}

EXTRAS = ["scheme", "backend", "kv_mode", "soc", "ppl_deployed", "ppl_qdq_sub", "ppl_deployed_vs_qdq",
          "top1_deployed_vs_qdq"]


def _assert_three_runs(report):
    from qexp.report import formatted

    table = formatted(report.table)
    # largest deployed program first, the PyTorch run (weights only) last
    assert list(table["target"]) == ["x86_emulator", "cpu", "pytorch"]
    assert list(table["backend"]) == ["htp", "xnnpack", "none"]
    assert list(table["scheme"]) == ["16a8w", "8da4w", "16a4w"]
    assert list(table["KV mode"]) == ["smart_mask", "-", "-"] and list(table["observer"]) == ["minmax", "-", "minmax"]
    assert list(table["calibration"]) == ["wikitext 8x256", "-", "wikitext 8x256"]
    assert list(table["PPL deployed"]) == ["23.10", "27.00", "-"]
    assert list(table["Δ vs FP"]) == ["+2.4%", "+8.4%", "+20.0%"]  # QDQ where the run has one, else deployed
    assert "PPL HTP" not in table and "PPL XNNPACK" not in table
    assert "deployed_eval_tokens" in report.data  # the CSV keeps the subset figures the notes point to
    assert any("not phone speed" in n for n in report.notes) and any("target=cpu" in n for n in report.notes)
    # the HTP run scored 255 tokens of one window; the XNNPACK run all 8 x 255 (no subset to mention)
    subset = [n for n in report.notes if "predicted tokens" in n]
    assert len(subset) == 1 and "first 255 predicted tokens" in subset[0] and "2040" not in subset[0]


def test_report_puts_cpu_and_emulator_rows_side_by_side():
    """Rows of different backends and targets in one table: backend, target and the notes say which is which."""
    from qexp.report import build_report, formatted

    _assert_three_runs(build_report(pd.DataFrame([HTP, XNNPACK, PYTORCH])))
    extra = formatted(build_report(pd.DataFrame([HTP, XNNPACK, PYTORCH]), EXTRAS).table)
    assert list(extra["SoC"]) == ["SM8650", "-", "-"]
    assert list(extra["Δ deployed vs QDQ"]) == ["+0.4%", "-", "-"]
    assert list(extra["top-1 deployed vs QDQ"]) == ["0.95", "-", "-"]


def test_report_shows_the_htp_estimate_labelled_beside_measured_speed():
    """An HTP run with a phone estimate: its speed columns show the estimate and say so; the XNNPACK run's stay
    measured; the emulator's own timings stay available as their own columns; the plot never joins them."""
    from qexp.report import build_report, formatted
    from qexp.report.plots import speed_figure

    estimated = {**HTP, "metrics.decode_tok_s_est": 250.0, "metrics.ttft_ms_est": 4.0,
                 "metrics.prefill_tok_s_est": 8000.0, "metrics.decode_tok_s_est_err": 0.15,
                 "tags.speed_source": "estimate:roofline-v1+0123abcd"}
    report = build_report(pd.DataFrame([estimated, XNNPACK, PYTORCH]),
                          ["model", "scheme", "target", "ppl_qdq", "decode_tok_s", "ttft_ms", "speed_source",
                           "decode_tok_s_emulator"])
    table = formatted(report.table)
    # the header says the column holds an estimate beside a measurement; each row's kind is in `speed`
    assert list(table["decode tok/s (est. or measured: see speed)"]) == ["250", "60.00", "-"]
    assert list(table["speed"]) == ["estimate SM8650", "measured cpu", "-"]
    assert list(table["decode tok/s (x86_emulator)"]) == ["0.20", "-", "-"]
    assert any("estimate:roofline-v1+0123abcd" in n and "15%" in n for n in report.notes)
    fig = speed_figure(report.data)
    fronts = {line.get_label() for line in fig.axes[0].get_lines()}
    assert not any("target" in label for label in fronts)
    assert fig.axes[0].get_xlabel().startswith("decode speed (tokens/s)")
    # two estimate versions in one report: each row names its version, so they are not one axis
    newer = {**estimated, "tags.speed_source": "estimate:roofline-v2+89abcdef", "metrics.decode_tok_s_est": 240.0}
    table = formatted(build_report(pd.DataFrame([estimated, newer]), ["model", "decode_tok_s", "speed_source"]).table)
    assert list(table["speed"]) == ["estimate SM8650 (roofline-v1+0123abcd)", "estimate SM8650 (roofline-v2+89abcdef)"]


def test_report_reads_runs_logged_under_legacy_names():
    """An existing store's runs (ppl_htp, backend.kind, no scheme tag, ...) give the same table."""
    from qexp.report import build_report, formatted, with_current_names

    old = pd.DataFrame([OLD_HTP, OLD_XNNPACK, OLD_PYTORCH])
    runs = with_current_names(old)
    _assert_three_runs(build_report(runs))
    # old runs logged backend.soc and kv.name on every run: only the HTP one compiled for a SoC and ran a KV updater
    extra = formatted(build_report(runs, EXTRAS).table)
    new = formatted(build_report(pd.DataFrame([HTP, XNNPACK, PYTORCH]), EXTRAS).table)
    pd.testing.assert_frame_equal(extra, new, check_dtype=False)
    assert list(runs["tags.deployed_eval_path"].fillna("-")) == ["prefill", "-", "-"]
    assert list(runs["metrics.logits_sqnr_db_qdq_vs_fp"].fillna(0)) == [30.0, 0, 0]
    assert list(runs["metrics.logits_sqnr_db_deployed_vs_fp"].fillna(0)) == [0, 25.0, 0]
    # a store holding old and new runs: each keeps its own values, today's names win
    mixed = with_current_names(pd.DataFrame([HTP, OLD_XNNPACK, OLD_PYTORCH]))
    _assert_three_runs(build_report(mixed))
    assert with_current_names(runs).equals(runs)  # idempotent


def test_report_refuses_incomparable_synthetic_runs():
    from qexp.report import ReportError, build_report

    runs = pd.DataFrame([HTP, {**PYTORCH, "params.eval.n_windows": "2"}])
    with pytest.raises(ReportError, match="not comparable") as refused:
        build_report(runs)
    assert "window count=2" in str(refused.value) and "window count=8" in str(refused.value)
    report = build_report(runs, allow_mixed=True)
    assert {"windows", "window len", "text"} <= set(report.table.columns)
    assert any("Mixed evaluation settings" in note for note in report.notes)
    with pytest.raises(ReportError, match="three names"):
        build_report(pd.DataFrame([HTP]), pivot=["scheme", "backend"])


def test_report_refuses_runs_from_different_cpus():
    """with the same pinned kernels an Intel and an AMD host calibrate to different programs (QDQ 47.165 vs
    46.994 on SmolLM2's default experiment), so a table does not put their runs side by side silently."""
    from qexp.report import ReportError, build_report

    intel, amd = ({**HTP, "run_id": f"on_{name}", "tags.cpu": name} for name in ("Intel Xeon", "AMD EPYC 9B14"))
    with pytest.raises(ReportError, match="not comparable") as refused:
        build_report(pd.DataFrame([intel, amd]))
    assert "CPU=Intel Xeon" in str(refused.value) and "CPU=AMD EPYC 9B14" in str(refused.value)
    build_report(pd.DataFrame([intel, {**intel, "run_id": "again"}]))  # one CPU: fine


def test_cached_cpu_results_are_keyed_by_the_cpu_model(monkeypatch):
    """A cache shared between hosts must not serve one CPU's calibrated program or perplexities to another."""
    import qexp.core.provenance as provenance

    monkeypatch.setattr(provenance, "cpu_model", lambda: "Intel Xeon")
    intel = provenance.numerics_key()
    monkeypatch.setattr(provenance, "cpu_model", lambda: "AMD EPYC 9B14")
    assert provenance.numerics_key() != intel and provenance.numerics_key().endswith("AMD EPYC 9B14")


def test_cached_cpu_results_are_keyed_by_the_mkl_branch(monkeypatch):
    """MKL_CBWR picks MKL's code branch, and the branches give different sgemm bits on one CPU (AVX2, COMPATIBLE and
    AUTO on an Intel Xeon host): a run with another branch must not read the pinned branch's cached results, and the
    pinned branch keeps the keys it always had; a table does not mix the branches either."""
    import qexp.core.provenance as provenance
    from qexp.report import ReportError, build_report

    monkeypatch.setattr(provenance, "cpu_model", lambda: "Intel Xeon")
    pinned = provenance.numerics_key()
    assert pinned.endswith("Intel Xeon") and provenance.PINNED_MKL_CBWR == "AVX2,STRICT"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert provenance.numerics_key() == pinned + "-mkl_cbwr=COMPATIBLE"
    monkeypatch.delenv("MKL_CBWR")
    assert provenance.numerics_key() == pinned + "-mkl_cbwr=unset"
    runs = [{**HTP, "run_id": f"mkl_{branch}", "tags.numerics.mkl_cbwr": branch}
            for branch in ("AVX2,STRICT", "COMPATIBLE")]
    with pytest.raises(ReportError, match="MKL branch=COMPATIBLE"):
        build_report(pd.DataFrame(runs))


def test_report_labels_htp_exact_rows():
    """Runs whose QDQ phase used HTP's integer arithmetic (eval.htp_exact) get a QDQ-arithmetic column and a note
    when the table also holds fake-quant runs, runs of an older model of it name that model; a table of one
    arithmetic stays as it was."""
    from qexp.report import build_report

    from qexp.quant.htp_arithmetic_pass import MODELLED_OPS

    exact = {**HTP, "run_id": "exact", "tags.qdq_arithmetic": "htp_exact", "metrics.ppl_qdq": 24.1,
             "tags.htp_exact_model": MODELLED_OPS}
    norms = {**HTP, "run_id": "norms", "tags.qdq_arithmetic": "htp_exact", "metrics.ppl_qdq": 24.15,
             "tags.htp_exact_model": "conv_accumulator_floor,rms_norm_floor"}
    older = {**HTP, "run_id": "older", "tags.qdq_arithmetic": "htp_exact", "metrics.ppl_qdq": 24.0}  # before norms
    report = build_report(pd.DataFrame([HTP, exact, norms, older]))
    assert list(report.table.columns)[:3] == ["model", "scheme", "QDQ arithmetic"]
    assert sorted(report.table["QDQ arithmetic"]) == ["fake_quant", "htp_exact", "htp_exact (conv_accumulator_floor)",
                                                      "htp_exact (conv_accumulator_floor,rms_norm_floor)"]
    assert any("htp_exact" in note for note in report.notes)
    assert "QDQ arithmetic" not in build_report(pd.DataFrame([HTP])).table.columns


def test_pareto_front():
    from qexp.report import pareto_front

    speed = np.array([10.0, 20.0, 30.0, 25.0])
    ppl = np.array([5.0, 6.0, 9.0, 10.0])  # (25, 10) is dominated by (30, 9)
    assert list(pareto_front(speed, ppl)) == [0, 1, 2]


def _log(client, experiment_id, row, tags=None):
    """One FINISHED run with row's params./metrics./tags. columns."""
    run = client.create_run(experiment_id, tags={**{k[5:]: str(v) for k, v in row.items() if k.startswith("tags.")},
                                                 **(tags or {})})
    for key, value in row.items():
        if key.startswith("params."):
            client.log_param(run.info.run_id, key[7:], value)
        elif key.startswith("metrics."):
            client.log_metric(run.info.run_id, key[8:], float(value))
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_main_on_a_store_of_legacy_runs(tmp_path):
    """load_runs -> today's names; the CLI writes results/-style output and attaches it to the sweep's parent."""
    from mlflow.tracking import MlflowClient

    from qexp.report import load_runs, main
    from qexp.report.query import ROLE_TAG, SWEEP_TAG

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("legacy", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(experiment, tags={ROLE_TAG: "sweep", SWEEP_TAG: "grid"}).info.run_id
    client.set_terminated(parent, "FINISHED")
    for row in (OLD_HTP, OLD_XNNPACK, OLD_PYTORCH):
        _log(client, experiment, {k: v for k, v in row.items() if k != "run_id"}, {SWEEP_TAG: "grid"})

    runs = load_runs("legacy", "grid", tracking_uri=uri)
    assert len(runs) == 3 and parent not in set(runs["run_id"])
    assert sorted(runs["tags.scheme"]) == ["16a4w", "16a8w", "8da4w"]
    assert sorted(runs["params.backend.kv_update"].fillna("-")) == ["-", "-", "smart_mask"]

    out = tmp_path / "results"
    assert main(["--experiment", "legacy", "--sweep", "grid", "--tracking-uri", uri, "--out-dir", str(out),
                 "--name", "grid"]) == 0
    md = (out / "grid.md").read_text()
    for header in ("backend", "KV mode", "PPL deployed", "Δ vs FP", "target"):
        assert f" {header} " in md
    assert "not phone speed" in md and "first 255 predicted tokens" in md
    # the header says where and when: hosts (CPU), code commits, dates (legacy runs lack the first two: "?")
    assert re.search(r"3 runs; host \? \(\?\), code commit \?, run 20\d\d-\d\d-\d\d\)", md), md[:600]
    data = pd.read_csv(out / "grid.csv")
    assert sorted(data["ppl_deployed"].dropna()) == [23.1, 27.0]
    assert {"deployed_eval_tokens", "ppl_qdq_sub", "ppl_deployed_vs_qdq"} <= set(data.columns)
    assert (out / "grid_ppl_vs_size.png").exists() and (out / "grid_ppl_vs_speed.png").exists()
    artifacts = {a.path for a in client.list_artifacts(parent, "report")}
    assert {"report/grid.md", "report/grid.csv", "report/grid_ppl_vs_speed.png"} <= artifacts


def test_device_layout_gives_one_row_per_configuration_and_device():
    """The seeds' layout: an HTP run gives a CPU (QDQ) row and an HTP emulator row, a QDQ-only run one row, the
    model's FP reference one row; config names the algorithm (RTN when none) and the grids."""
    from qexp.report.devices import device_table
    from qexp.report.table import derived_columns

    awq = {**PYTORCH, "run_id": "d", "tags.config_hash": "4", "tags.algorithm": "awq",
           "tags.weight_grid": "int3 sym block 64", "tags.lm_head_grid": "int8 sym per channel",
           "tags.deployable": "false", "params.quant.scheme": "16a3w_block", "tags.scheme": "16a3w_block",
           "metrics.ppl_qdq": 40.0, "metrics.ppl_qdq_vs_fp": 0.6}
    table = device_table(derived_columns(pd.DataFrame([HTP, XNNPACK, PYTORCH, awq])))
    rows = {(r.precision, r.device): r for r in table.itertuples()}
    assert list(table["precision"])[0] == "fp32" and table.iloc[0]["PPL (all windows)"] == 24.9
    htp = rows[("16a8w", "HTP (x86 emulator)")]
    assert htp[5] == 23.1 and np.isnan(htp[6])  # deployed subset only
    cpu = rows[("16a8w", "CPU (QDQ)")]
    assert cpu[5] == 23.0 and cpu[6] == 25.5  # QDQ on the deployed subset and on all windows
    assert rows[("16a4w", "CPU (QDQ)")].config.startswith("RTN")
    assert rows[("16a3w_block", "CPU (QDQ)")].config == "awq, int3 sym block 64, lm head int8 sym per channel"
    assert rows[("16a3w_block", "CPU (QDQ)")].deployable == "false"
    assert ("fp32", "XNNPACK (CPU)") not in rows  # the XNNPACK run's QNN scheme is fp32: no QDQ row of its own
    # an algorithm tagged with its non-default settings is named once (not again from its logged params)
    tuned = {**awq, "run_id": "g", "tags.algorithm": "awq(clip=false)", "params.algorithm.awq.clip": "False"}
    table = device_table(derived_columns(pd.DataFrame([PYTORCH, tuned])))
    assert list(table[table["precision"] == "16a3w_block"]["config"]) == [
        "awq(clip=false), int3 sym block 64, lm head int8 sym per channel"]

    # the same configuration run QDQ-only too: one CPU row (the subset from the HTP run); other numbers stay apart
    qdq_only = {**HTP, "run_id": "e", "metrics.ppl_deployed": np.nan, "metrics.ppl_qdq_sub": np.nan}
    other = {**qdq_only, "run_id": "f", "metrics.ppl_qdq": 26.5}
    table = device_table(derived_columns(pd.DataFrame([HTP, qdq_only, other])))
    cpu = table[(table["precision"] == "16a8w") & (table["device"] == "CPU (QDQ)")]
    assert sorted(cpu["PPL (all windows)"]) == [25.5, 26.5]
    assert list(cpu.sort_values("PPL (all windows)")["PPL (deployed subset)"].fillna(-1)) == [23.0, -1]
