"""Same config, same numbers, whatever the cache holds: a cold run (calibrates, builds every cache entry) and a warm
run (finds them) give identical results. It failed on AMD hosts before qexp pinned PyTorch's CPU numerics:
QnnQuantizer's constructor turns MKLDNN off there, so only the cold run evaluated without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from mlflow.tracking import MlflowClient

from helpers import REPO, TINY
from qexp.pipeline import run_experiment

RESULTS = ("ppl_fp", "ppl_qdq", "word_ppl_qdq", "bits_per_byte_qdq", "logits_sqnr_db_qdq_vs_fp",
           "top1_agreement_qdq_vs_fp")
# channels >= ~512: below that PyTorch's MKLDNN and native 1x1 convs agree bit for bit, and a test could not fail
WIDE = ["model.tiny.dim=512", "model.tiny.hidden_dim=1024", "model.tiny.n_heads=8", "model.tiny.n_layers=1"]


def test_cold_and_warm_runs_agree_exactly(compose, tmp_path):
    import torch

    cfg = compose(TINY + WIDE + ["quant=16a4w", f"cache_dir={tmp_path}", "tracking.force=true"])
    torch.backends.mkldnn.enabled = True  # what a fresh process starts with
    cold = run_experiment(cfg)
    torch.backends.mkldnn.enabled = True
    warm = run_experiment(cfg)
    assert cold.tags["qdq_cache_hit"] == "false" and warm.tags["qdq_cache_hit"] == "true"
    assert warm.tags["fp_eval_cache_hit"] == "true"
    assert {k: cold.metrics[k] for k in RESULTS} == {k: warm.metrics[k] for k in RESULTS}
    assert cold.tags["numerics.mkldnn"] == "off"



def test_thread_count_does_not_change_results(compose, tmp_path):
    """the same config with 1 and with 2 PyTorch threads gives bit-identical results (measured on SmolLM2 too:
    FP and QDQ logits identical), so the thread count is recorded (numerics.torch_threads) but needs no pinning."""
    import torch

    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cfg = compose(TINY + WIDE + ["quant=16a4w", f"cache_dir={tmp_path / str(threads)}", "tracking.force=true"])
            results[threads] = run_experiment(cfg)
    finally:
        torch.set_num_threads(before)
    assert [results[t].tags["numerics.torch_threads"] for t in (1, 2)] == ["1", "2"]
    assert {k: results[1].metrics[k] for k in RESULTS} == {k: results[2].metrics[k] for k in RESULTS}


def _qexp_run(tmp_path, env_extra, store):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    out = subprocess.run([sys.executable, "-m", "qexp", *TINY, *WIDE, "quant=16a4w", f"cache_dir={tmp_path / 'cache'}",
                          f"tracking.uri={store}", "tracking.experiment=numerics", "tracking.force=true"],
                         cwd=REPO, env={**env, **env_extra}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    run_id = re.search(r"qexp: run (\w+) ", out.stdout).group(1)
    return MlflowClient(store).get_run(run_id)


def test_cpu_kernels_are_pinned_and_recorded(tmp_path):
    """qexp pins PyTorch's CPU kernels to AVX2 on every host (they change QDQ perplexities by ~1% between AVX2,
    AVX512 and DEFAULT); a run with other kernels says so in its tags and never shares cache entries with them."""
    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    pinned = _qexp_run(tmp_path, {}, store)
    other = _qexp_run(tmp_path, {"ATEN_CPU_CAPABILITY": "default"}, store)
    assert pinned.data.tags["numerics.cpu_capability"] == "AVX2"
    assert other.data.tags["numerics.cpu_capability"] == "DEFAULT"
    assert pinned.data.tags["numerics.mkl_cbwr"] == "AVX2,STRICT"
    # the same cache directory: the second run must not reuse the first's FP evaluation or calibrated program
    assert other.data.tags["fp_eval_cache_hit"] == "false" and other.data.tags["qdq_cache_hit"] == "false"


def test_a_warm_rerun_reuses_what_its_change_does_not_touch(compose, store_uri, tmp_path):
    """Changing only the deployed phase's speed bench settings reuses the compiled program; changing only the
    evaluation windows reuses the calibrated QDQ program (and the compiled one). Each stage says so in its tag."""
    # its own cache: the first run must be cold whichever test files ran before in this worker
    base = TINY + [f"cache_dir={tmp_path / 'cache'}", "quant=16a8w", "backend=htp", "backend.model_mode=kv",
                   "backend.eval_tokens=32", "backend.bench.prompt_len=8", "backend.bench.new_tokens=4",
                   "backend.bench.repeats=1", "backend.bench.warmup=0"]
    runs = {
        "cold": run_experiment(compose(base + ["tracking.force=true"])),
        "bench changed": run_experiment(compose(base + ["backend.bench.new_tokens=6", "backend.bench.repeats=2"])),
        "windows changed": run_experiment(compose(base + ["eval.limit=3"])),
    }
    tags = {label: MlflowClient(store_uri).get_run(r.run_id).data.tags for label, r in runs.items()}
    assert tags["bench changed"]["pte_cache_hit"] == "true" and tags["bench changed"]["qdq_cache_hit"] == "true"
    assert tags["windows changed"]["qdq_cache_hit"] == "true" and tags["windows changed"]["pte_cache_hit"] == "true"
    assert runs["bench changed"].metrics["ppl_deployed"] == runs["cold"].metrics["ppl_deployed"]
    # the emulator's evaluation of the same program on the same windows is read back, not run again
    assert tags["cold"]["deployed_eval_cache_hit"] == "false"
    assert tags["bench changed"]["deployed_eval_cache_hit"] == "true"
