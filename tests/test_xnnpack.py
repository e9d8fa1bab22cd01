"""backend=xnnpack on the tiny model: real ExecuTorch LLM export, XNNPACK delegation, the .pte run through the
pybindings; and the speed harness's statistics on a synthetic workload."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from helpers import TINY

XNN = TINY + ["quant=fp32", "backend=xnnpack", "backend.bench.new_tokens=8", "backend.bench.repeats=3",
              "backend.bench.warmup=1"]


def _run(compose, overrides):
    from qexp.pipeline import run_experiment

    return run_experiment(compose(XNN + overrides))


# 256-token windows: the fp32 program of tests/test_tasks.py (the same key), compiled once for both files
FP32 = ["backend.qmode=fp32", "eval.seq_len=256"]


def test_fp32_pte_matches_eager(compose, store_uri):
    result = _run(compose, FP32)
    m = result.metrics
    # the same function, run by ExecuTorch's llama transformer + XNNPACK instead of the eager static llama
    assert abs(m["ppl_deployed"] / m["ppl_fp"] - 1) < 1e-4
    assert m["top1_agreement_deployed_vs_fp"] > 0.99
    for name in ("ttft_ms", "ttft_ms_p90", "prefill_tok_s", "decode_tok_s", "decode_tok_s_p10", "pte_bytes",
                 "mem_bandwidth_gbs", "decode_bytes_per_token", "decode_bw_efficiency", "threads"):
        assert name in m and np.isfinite(m[name]) and m[name] > 0, name
    assert m["speed_repeats"] == 3 and m["threads"] == 2
    run = MlflowClient(store_uri).get_run(result.run_id)
    assert run.data.tags["target"] == "cpu" and run.data.tags["phases"] == "fp,xnnpack" and run.data.tags["cpu"]
    assert run.data.params["backend.qmode"] == "fp32"


@pytest.mark.parametrize("qmode,bound", [("8da4w", 0.2), ("8da8w", 0.02)])
def test_quantized_pte_close_to_eager(compose, qmode, bound):
    m = _run(compose, [f"backend.qmode={qmode}", "backend.embedding_quantize='8,0'"]).metrics
    assert 0 < abs(m["ppl_deployed_vs_fp"]) < bound, m["ppl_deployed_vs_fp"]  # quantized: close, not identical
    assert m["decode_tok_s"] > 0


def test_cached_program_reused(compose):
    m = _run(compose, FP32).metrics
    assert m["time_export_xnnpack_s"] < 5  # the cache hit of the first test's program


@pytest.mark.parametrize("override,message", [
    ("backend.qmode=3bit", "unknown backend.qmode '3bit'"),
    ("backend.qmode=4w", "logits are wrong"),
    ("backend.qmode=int8", "export fails"),
    ("backend.embedding_quantize='5,0'", "embedding_quantize"),
    ("backend.group_size=0", "group_size"),
    ("backend.threads=0", "threads"),
])
def test_bad_options_rejected(compose, override, message):
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(XNN + [override]))


def test_qnn_scheme_with_xnnpack_rejected(compose):
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match="backend.qmode"):
        validate(compose(TINY + ["quant=16a4w", "backend=xnnpack"]))


# ---------------------------------------------------------------- the harness itself
def test_speed_statistics_on_synthetic_workload():
    from qexp.backends.bench import Generation, measure

    calls = []

    def generate():  # 20 ms "prefill" of 10 tokens, then 5 tokens at 4 ms each
        calls.append(1)
        start = time.perf_counter()
        time.sleep(0.020)
        mid = time.perf_counter()
        time.sleep(0.020)
        end = time.perf_counter()
        return Generation([1] * 6, mid - start, mid - start, end - mid, 10, {"extra": 1.0})

    metrics, last = measure(generate, warmup=2, repeats=5)
    assert len(calls) == 7 and metrics["speed_repeats"] == 5 and metrics["extra"] == 1.0
    assert 20 <= metrics["ttft_ms"] < 30 and metrics["ttft_ms_p90"] >= metrics["ttft_ms"]
    assert 330 < metrics["prefill_tok_s"] <= 500  # 10 tokens / ~20 ms
    assert 160 < metrics["decode_tok_s"] <= 250 and metrics["decode_tok_s_p10"] <= metrics["decode_tok_s"]
    assert 4 <= metrics["decode_ms_per_token"] < 6


def test_speed_statistics_exact():
    from qexp.backends.bench import Generation, summarize

    runs = [Generation([0, 1, 2], t, t, 2 * t, 4) for t in (0.1, 0.2, 0.3, 0.4, 0.5)]
    m = summarize(runs)
    assert m["ttft_ms"] == pytest.approx(300) and m["ttft_ms_p90"] == pytest.approx(460)
    assert m["prefill_tok_s"] == pytest.approx(4 / 0.3)
    assert m["decode_tok_s"] == pytest.approx(2 / 0.6) and m["decode_ms_per_token"] == pytest.approx(300)
    with pytest.raises(ValueError):
        from qexp.backends.bench import measure

        measure(lambda: runs[0], warmup=0, repeats=0)


def test_roofline_bytes_per_token():
    from qexp.backends.xnnpack.roofline import decode_bytes_per_token

    params = {"dim": 64, "vocab_size": 1000, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2}
    table = 1000 * 64 * 4
    assert decode_bytes_per_token(10 * table, params, None, 0) == pytest.approx(9 * table + 64 * 4)
    # 8-bit embedding: a quarter of the table in the program; KV: 2 (k, v) x 2 layers x 2 heads x 16 dims x pos x 4 B
    assert decode_bytes_per_token(table, params, "8,0", 10) == pytest.approx(
        table - table / 4 + 64 + 2 * 2 * 2 * 16 * 10 * 4)
