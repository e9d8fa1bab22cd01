"""diagnostics/diag_qdq_perturb.py: its perturbed quantization is the QDQ program's when it rounds to nearest, is
seeded, leaves copies and inputs exact; on the tiny model the whole diagnosis runs (CPU); a deployed run is placed
on the noise rows only when it is the same program on the same windows."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from helpers import REPO, TINY

sys.path.insert(0, str(REPO))


def _quantize(x, rounding, sigma=0.0, seed=0):
    from diagnostics.diag_qdq_perturb import Perturbation, _Active, perturbed_fake_quantize

    _Active.perturbation = Perturbation(rounding, sigma, seed)
    _Active.generator = torch.Generator().manual_seed(seed)
    try:
        return perturbed_fake_quantize(x.clone(), 0.01, 32768, 0, 65535, "test")
    finally:
        _Active.perturbation, _Active.generator = Perturbation(), None


def test_perturbed_rounding_against_its_definition():
    from qexp.quant.fold import fake_quantize

    x = torch.randn(64, 32) * 3
    assert torch.equal(_quantize(x, "round"), fake_quantize(x.clone(), 0.01, 32768, 0, 65535))  # bit for bit
    lsb = torch.tensor(0.01, dtype=torch.float32)
    floor, ceil = _quantize(x, "floor"), _quantize(x, "ceil")
    assert torch.equal(floor, torch.floor(x * (1.0 / 0.01)) * lsb)
    assert torch.equal(ceil, torch.ceil(x * (1.0 / 0.01)) * lsb)
    steps = ((_quantize(x, "gauss", 1.0) - fake_quantize(x.clone(), 0.01, 32768, 0, 65535)) / 0.01).round()
    # N(0, 1) LSB before rounding: about half the values move, by whole steps, both ways, unbiased
    assert 0.4 < (steps != 0).float().mean() < 0.8 and steps.min() < 0 < steps.max() and abs(steps.mean()) < 0.1
    assert torch.equal(_quantize(x, "gauss", 1.0, seed=4), _quantize(x, "gauss", 1.0, seed=4))
    assert not torch.equal(_quantize(x, "gauss", 1.0, seed=4), _quantize(x, "gauss", 1.0, seed=5))


def test_variants_parse_and_bad_ones_are_refused():
    from diagnostics.diag_qdq_perturb import Perturbation, parse_variants

    variants = parse_variants("round, gauss:0.5,floor", seeds=2)
    assert [v.label for v in variants] == ["round", "gauss:0.5 seed 0", "gauss:0.5 seed 1", "floor"]
    with pytest.raises(SystemExit, match="gauss:0.5"):
        parse_variants("gauss:half", seeds=1)
    with pytest.raises(ValueError, match="unknown rounding"):
        parse_variants("stochastic", seeds=1)
    with pytest.raises(ValueError, match="positive sigma"):
        Perturbation("gauss", 0.0)


def test_perturbation_diagnosis_on_the_tiny_model(compose):
    from diagnostics.diag_qdq_perturb import diagnose, parse_variants

    cfg = compose(TINY + ["quant=16a4w", "backend=none", "eval.limit=4"])
    table = diagnose(cfg, parse_variants("round,gauss:1,floor", seeds=2)).set_index("variant")
    meta = table.attrs
    # rounding to nearest is the QDQ program itself
    assert table.loc["round", "ppl"] == meta["ppl_qdq"] and table.loc["round", "logits_sqnr_db"] == math.inf
    # only computed activations are perturbed: every layer's norms, projections, products are; copies and inputs not
    assert meta["activations"] > 30 and meta["activations_exact"] > 30 and meta["windows"] == 4
    for variant in ("gauss:1 seed 0", "gauss:1 seed 1", "floor"):
        row = table.loc[variant]
        assert row.ppl != meta["ppl_qdq"] and 35 < row.logits_sqnr_db < 70, row
        assert 65 < row.op_sqnr_db_median < 95 and 65 < row.norm_sqnr_db_median < 95, row
        assert row.ci_low_pct <= row.delta_pct <= row.ci_high_pct
    assert table.loc["gauss:1 seed 0", "ppl"] != table.loc["gauss:1 seed 1", "ppl"]

    # --only: just the norms' outputs (two per layer and the final norm), the rest left exact
    norms = diagnose(cfg, parse_variants("gauss:1", seeds=1), only="norm:rms_norm")
    assert norms.attrs["activations"] == 2 * 2 + 1
    assert norms.attrs["activations"] + norms.attrs["activations_exact"] == meta["activations"] + meta[
        "activations_exact"]
    fewer = norms.iloc[0]  # fewer ops perturbed: the logits move less
    assert fewer.ppl != meta["ppl_qdq"] and fewer.logits_sqnr_db > table.loc["gauss:1 seed 0"].logits_sqnr_db
    with pytest.raises(SystemExit, match="matches no computed activation"):
        diagnose(cfg, parse_variants("gauss:1", seeds=1), only="no_such_module")


def test_noise_cost_interpolates_between_the_noise_levels():
    import pandas as pd

    from diagnostics.diag_qdq_perturb import noise_cost_at

    table = pd.DataFrame({"rounding": ["round", "gauss", "gauss", "gauss", "floor"],
                          "sigma_lsb": [0, 0.5, 0.5, 1.0, 0], "top1": [1.0, 0.82, 0.78, 0.7, 0.3],
                          "delta_pct": [0.0, 4.0, 6.0, 25.0, 900.0]})
    assert noise_cost_at(table, 0.75) == pytest.approx(15.0)  # halfway between sigma 0.5 (0.80, 5%) and 1 (0.70, 25%)
    assert noise_cost_at(table, 0.9) == pytest.approx(2.5)  # between the program itself (1.0, 0%) and sigma 0.5
    assert noise_cost_at(table, 0.6) is None  # beyond the noisiest level: not extrapolated; floor/ceil not used


def test_deployed_run_must_be_the_same_model_scheme_windows_and_qdq_program(compose, store_uri):
    import mlflow

    from diagnostics.diag_qdq_perturb import deployed_figures, fetch_run

    mlflow.set_tracking_uri(store_uri)
    mlflow.set_experiment("tests")
    with mlflow.start_run() as run:
        mlflow.log_params({"model.name": "tiny"})
        mlflow.set_tags({"scheme": "16a4w", "text_sha256": "abc", "target": "x86_emulator"})
        mlflow.log_metrics({"ppl_deployed_vs_qdq": 0.151, "ppl_deployed_vs_qdq_ci_low": 0.13,
                            "ppl_deployed_vs_qdq_ci_high": 0.176, "top1_agreement_deployed_vs_qdq": 0.75,
                            "deployed_eval_windows": 8, "ppl_qdq": 99.178074})
    cfg = compose(TINY + ["quant=16a4w"], tracked=False)
    found = fetch_run(store_uri, run.info.run_id)
    meta = {"text_sha256": "abc", "windows": 8, "ppl_qdq": 99.1780742}
    figures = deployed_figures(found, cfg, meta)
    assert figures["delta_pct"] == pytest.approx(15.1) and figures["top1"] == 0.75
    with pytest.raises(SystemExit, match="windows 8.0 \\(here 4.0\\)"):
        deployed_figures(found, cfg, {**meta, "windows": 4})
    with pytest.raises(SystemExit, match="QDQ perplexity 99.178074 \\(here 45.01\\)"):  # another QDQ program
        deployed_figures(found, cfg, {**meta, "ppl_qdq": 45.01})
    with pytest.raises(SystemExit, match="scheme '16a4w' \\(here '16a8w'\\)"):
        deployed_figures(found, compose(TINY + ["quant=16a8w"], tracked=False))
    with pytest.raises(SystemExit, match="not found"):
        fetch_run(store_uri, "0" * 32)
