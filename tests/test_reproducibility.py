"""Same config, same numbers, whatever the cache holds: a cold run (calibrates, builds every cache entry) and a warm
run (finds them) give identical results. It failed on AMD hosts before qexp pinned PyTorch's CPU numerics:
QnnQuantizer's constructor turns MKLDNN off there, so only the cold run evaluated without it."""

from __future__ import annotations

from helpers import TINY
from qexp.pipeline import run_experiment

RESULTS = ("ppl_fp", "ppl_qdq", "word_ppl_qdq", "bits_per_byte_qdq", "logits_sqnr_db_qdq_vs_fp",
           "top1_agreement_qdq_vs_fp")


def test_cold_and_warm_runs_agree_exactly(compose, tmp_path):
    import torch

    # channels >= ~512: below that PyTorch's MKLDNN and native 1x1 convs agree bit for bit, and the test could not fail
    wide = ["model.tiny.dim=512", "model.tiny.hidden_dim=1024", "model.tiny.n_heads=8", "model.tiny.n_layers=1"]
    cfg = compose(TINY + wide + ["quant=16a4w", f"cache_dir={tmp_path}", "tracking.force=true"])
    torch.backends.mkldnn.enabled = True  # what a fresh process starts with
    cold = run_experiment(cfg)
    torch.backends.mkldnn.enabled = True
    warm = run_experiment(cfg)
    assert cold.tags["qdq_cache_hit"] == "false" and warm.tags["qdq_cache_hit"] == "true"
    assert warm.tags["fp_eval_cache_hit"] == "true"
    assert {k: cold.metrics[k] for k in RESULTS} == {k: warm.metrics[k] for k in RESULTS}
    assert cold.tags["numerics.mkldnn"] == "off"
