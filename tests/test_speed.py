"""The HTP speed estimate (qexp/speed): the published figures and the fit, the byte count, bad input, and the
estimate's direction on real compiled tiny programs (their QNN DDR summaries)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, TINY
from qexp.core.errors import ConfigError
from qexp.speed import estimate_config, estimate_program
from qexp.speed.bytes import Shapes, stream_bytes, weight_bytes
from qexp.speed.data import published, quant_config
from qexp.speed.ddr import parse, total
from qexp.speed.fit import fitted
from qexp.quant.grid import WeightGrid

SMOLLM2 = Shapes(n_layers=30, dim=576, hidden_dim=1536, n_heads=9, n_kv_heads=3, head_dim=64, vocab_size=49152)


def test_every_published_point_names_a_source_and_a_shipped_quant_config():
    data = published()
    for point in data.decode + data.ttft:
        assert point.source in data.sources and point.value > 0
        assert point.bytes_per_call.weights > 0
        assert point.use or point.why, point.name  # a point left out of the fit says why
    assert set(data.socs_with_figures) == {"SM8650", "SM8750", "SM8850"}


def test_leave_one_out_error_as_documented():
    """The figures docs/htp-speed.md states: refitting without each point predicts it this well (an estimate that
    drifts from them must update the docs)."""
    fit = fitted()
    assert fit.error("decode") <= 0.25 and fit.error("ttft") <= 0.25
    held_out = next(p for p in fit.decode if p.point.source == "et_pr20587" and p.point.model == "smollm2_135m")
    assert abs(held_out.error) <= 0.25  # SmolLM2 16a8w on SM8750, 254 tok/s, predicted without it
    # a model nobody has timed: each model's figures predicted by a fit without any of them
    assert fit.error("decode", "median", "model") <= 0.15 and fit.error("decode", "worst", "model") <= 0.35
    assert fit.error("decode", "worst", "point") <= 0.30
    # a floor is a bound: no held-out fit predicts one more than 15% below it
    assert all(p.below_floor("model") >= -0.15 for p in fit.decode)
    low, high = fit.band("decode")
    assert 0.7 < low < 1 < high < 1.3


def test_floors_bound_the_fit_from_below_only(tmp_path):
    """A floor far under the model's prediction leaves the fit as it is; the same figure as a measurement moves it."""
    import yaml

    data = yaml.safe_load(published().path.read_text())
    extra = {"model": "smollm2_135m", "quant": "16a8w", "context": 1024, "soc": "SM8750", "tok_s": 50,
             "source": "et_ci"}
    fits = {}
    for kind in ("floor", "measured"):
        path = tmp_path / f"{kind}.yaml"
        path.write_text(yaml.safe_dump({**data, "decode": data["decode"] + [{**extra, "kind": kind}]}))
        fits[kind] = fitted(str(path)).model
    assert fits["floor"].bandwidth_efficiency == pytest.approx(fitted().model.bandwidth_efficiency, rel=1e-6)
    assert fits["measured"].bandwidth_efficiency != pytest.approx(fitted().model.bandwidth_efficiency, rel=1e-3)


def test_weight_bytes_as_htp_stores_them():
    out, cols = 64, 128
    assert weight_bytes(out, cols, WeightGrid(8)) == out * cols + 4 * out
    # 4-bit per channel is lowered as LPBQ with one block per row: one 4-bit block scale per row
    assert weight_bytes(out, cols, WeightGrid(4)) == out * cols / 2 + 4 * out + 0.5 * out
    assert weight_bytes(out, cols, WeightGrid(4, block_size=32)) == out * cols / 2 + 4 * out + 0.5 * out * 4


def test_stream_bytes_follow_the_recipe():
    w8 = stream_bytes(SMOLLM2, quant_config("16a8w"), 256)
    w4 = stream_bytes(SMOLLM2, quant_config("16a4w"), 256)
    assert w8.lm_head == w4.lm_head  # both keep the lm head at 8 bits
    assert w4.weights - w4.lm_head < 0.55 * (w8.weights - w8.lm_head)
    assert stream_bytes(SMOLLM2, quant_config("16a8w"), 1024).kv_cache == pytest.approx(4 * w8.kv_cache, rel=0.01)
    assert stream_bytes(SMOLLM2, quant_config("16a4w_block"), 256).kv_cache == pytest.approx(w8.kv_cache / 2)


def test_what_if_directions():
    def decode(quant, context=256):
        return estimate_config(SMOLLM2, quant_config(quant), "SM8750", context, 32, 128)[0]

    assert decode("16a4w").decode_tok_s > decode("16a8w").decode_tok_s
    assert decode("16a8w", 1024).decode_tok_s < decode("16a8w", 256).decode_tok_s
    by_ar = {ar: estimate_config(SMOLLM2, quant_config("16a8w"), "SM8750", 256, ar, 128)[0] for ar in (16, 64)}
    assert by_ar[64].ttft_ms < by_ar[16].ttft_ms  # 2 chunks instead of 8
    kv_mode = estimate_config(SMOLLM2, quant_config("16a8w"), "SM8750", 256, None, 128)[0]
    assert kv_mode.ttft_ms == pytest.approx(128 * kv_mode.decode_ms_per_token)
    faster = [decode("16a8w").decode_tok_s] + [
        estimate_config(SMOLLM2, quant_config("16a8w"), soc, 256, 32, 128)[0].decode_tok_s for soc in ("SM8850",)]
    assert faster[1] > faster[0]


def test_soc_without_figures_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match="SM8550.*SM8650, SM8750, SM8850"):
        estimate_config(SMOLLM2, quant_config("16a8w"), "SM8550", 256, 32, 32)


@pytest.mark.parametrize("args, message", [
    (["backend.soc=SM8550"], "no published HTP speed figures for SoC SM8550"),
    (["quant=16a3w"], "3-bit weights"),
    (["quant=fp32"], "quantized programs only"),
    (["backend.soc=SM9999"], "expected one of"),
])
def test_speed_command_bad_input_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "qexp.speed", *args], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_speed_command_prints_the_estimate():
    done = subprocess.run([sys.executable, "-m", "qexp.speed", "quant=16a4w", "backend.soc=SM8750"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "decode:" in done.stdout and "tok/s" in done.stdout and "estimate:" in done.stdout


def test_ddr_summary_parsed_and_summed():
    text = "\n".join(["noise", "[INFO] ====== DDR bandwidth summary ======", "[INFO] spill_bytes=0",
                      "[INFO] fill_bytes=16", "[INFO] write_total_bytes=100", "[INFO] read_total_bytes=2000",
                      "====== DDR bandwidth summary ======", "spill_bytes=1", "fill_bytes=0",
                      "write_total_bytes=10", "read_total_bytes=300", "====== DDR bandwidth summary ======"])
    summaries = parse(text)
    assert len(summaries) == 2  # the last header has no fields: not a summary
    assert total(summaries) == {"spill_bytes": 1, "fill_bytes": 16, "write_total_bytes": 110,
                                "read_total_bytes": 2300}
    assert total([]) is None


def test_simulated_cycles_read_from_the_finalize_events():
    from qexp.backends.htp.sim_cycles import estimates, total

    events = [("QNN (finalize) time", 103230), ("Graph Optimizations", 50062), ("Performance Estimates", 0),
              ("Simulated (Accelerator exec cycles)", 41445),
              ("Simulated (Accelerator exec cycles (lower estimate))", 38976),
              ("Simulated (Accelerator exec cycles (upper estimate))", 44211), ("Bandwidth Stats", 0),
              ("Input Fill", 172032), ("Output Spill", 65536),
              ("Missing Ops (Number of Ops with no Costs associated)", 0)]
    one = estimates(events)
    assert one == {"cycles": 41445, "cycles_lower": 38976, "cycles_upper": 44211, "input_fill_bytes": 172032,
                   "output_spill_bytes": 65536, "missing_ops": 0}
    assert estimates(events[:2]) is None  # a SoC QNN does not simulate: no performance estimates
    assert total([one, one])["cycles"] == 2 * 41445  # a sharded graph's contexts run one after the other
    assert total([one, None]) is None and total([]) is None


# ---------------------------------------------------------------- real compiled tiny programs

WIDE = ["model.tiny.dim=256", "model.tiny.hidden_dim=512", "model.tiny.vocab_size=2048"]  # weights dominate


HYBRID_16 = ["quant=16a8w", "backend.model_mode=hybrid", "backend.prefill_ar_len=16"]


@pytest.fixture(scope="module")
def compiled(compose, cache_dir, corpus):
    """compiled(overrides) -> (cfg, program, shapes): the tiny model (WIDE) calibrated and compiled for HTP."""
    from qexp.cache import Cache
    from qexp.data.calibration import build_calibration
    from qexp.backends.htp.lower import compile_pte
    from qexp.models import load_model
    from qexp.models.static_llama import StaticLlama
    from qexp.core.provenance import library_versions
    from qexp.quant.calibrate import quantize
    from qexp.core.timing import StageTimer

    model = load_model(compose(TINY + WIDE).model, Cache(cache_dir))
    shapes = Shapes.of(model.params)

    def build(overrides):
        cfg = compose(TINY + WIDE + ["backend=htp", *overrides])
        context = int(cfg.backend.max_seq_len)
        static = StaticLlama(model, context)
        calibration = build_calibration(cfg.calibration, corpus, model.tokenizer, True, context)
        qdq = quantize(static, cfg.quant, cfg.observer, calibration, Cache(cache_dir),
                       key=f"speed-{cfg.quant.name}-{context}", soc=cfg.backend.soc.value)
        program = compile_pte(model, cfg, qdq, static.r3, Cache(cache_dir), StageTimer(), library_versions())
        return cfg, program, shapes

    return build


def _estimate(built, prompt=32):
    cfg, program, shapes = built
    return estimate_program(shapes, cfg.quant, program.meta, prompt)


def test_compiled_programs_carry_qnn_ddr_summaries_and_the_estimate_follows_bits_and_context(compiled):
    # the hybrid AR-16 program's kv graph is the kv-mode program's (the next test compiles it; one compile for both)
    w8 = compiled(HYBRID_16)
    w4 = compiled(["quant=16a4w", "backend.model_mode=kv"])
    long = compiled(["quant=16a8w", "backend.model_mode=kv", "export.max_context_len=128"])
    reads = {}
    for name, built in (("w8", w8), ("w4", w4), ("long", long)):
        ddr = built[1].meta["ddr"]["kv_forward"]
        assert ddr["read_total_bytes"] > 0 and ddr["spill_bytes"] == 0, ddr
        reads[name] = ddr["read_total_bytes"]
    assert reads["w4"] < 0.75 * reads["w8"] and reads["long"] > reads["w8"]  # QNN's own count moves as the bytes do
    est = {name: _estimate(built) for name, built in (("w8", w8), ("w4", w4), ("long", long))}
    assert all(source == "qnn_ddr_summary" for _, source, _ in est.values())
    assert est["w4"][0].decode_tok_s > est["w8"][0].decode_tok_s > est["long"][0].decode_tok_s
    # QNN counts what the shapes and scheme say plus what else the graph moves (norms, RoPE tables, activations)
    for _, _, counts in est.values():
        ratio = counts["kv_forward"]["qnn"].total / counts["kv_forward"]["analytic"].total
        assert 0.9 < ratio < 1.4, ratio


def test_a_larger_prefill_graph_needs_fewer_chunks(compiled):
    small = compiled(["quant=16a8w", "backend.model_mode=hybrid", "backend.prefill_ar_len=8"])
    large = compiled(HYBRID_16)
    est_small, est_large = _estimate(small)[0], _estimate(large)[0]
    assert (est_small.prefill_ar_len, est_large.prefill_ar_len) == (8, 16)
    assert est_large.ttft_ms < est_small.ttft_ms  # 2 calls of AR-16 against 4 of AR-8 for 32 prompt tokens
    assert "prefill_forward" in large[1].meta["ddr"] and large[1].meta["ddr"]["prefill_forward"]["read_total_bytes"]


def test_sa8797_programs_carry_qnn_simulated_cycles(compiled):
    """SA8797: HTP's prepare simulates each graph (read through the graphFinalize hook); no published figures, so
    no time estimate, but the cycles and their bounds are in the program's meta.json."""
    cfg, program, shapes = compiled(["quant=16a8w", "backend.model_mode=kv", "backend.soc=SA8797"])
    sim = program.meta["sim"]["kv_forward"]
    assert 0 < sim["cycles_lower"] <= sim["cycles"] <= sim["cycles_upper"], sim
    assert sim["input_fill_bytes"] > 0 and sim["intermediate_spill_bytes"] == 0
    assert program.meta["ddr"]["kv_forward"]["read_total_bytes"] > 0
    with pytest.raises(ConfigError, match="SA8797"):
        estimate_program(shapes, cfg.quant, program.meta, 32)


def test_report_gives_qdq_only_runs_a_what_if_speed(compose, store_uri, tmp_path):
    """--speed-estimate: a QDQ-only run (no HTP phase) gets its config's estimate, labelled what-if; a SoC without
    figures is refused in one line."""
    from qexp.pipeline import run_experiment
    from qexp.report.cli import main

    result = run_experiment(compose(TINY + ["quant=16a4w", "tracking.experiment=speed_what_if"]))
    out = tmp_path / "out"
    assert main(["--experiment", "speed_what_if", "--tracking-uri", store_uri, "--speed-estimate", "SM8750",
                 "--columns", "model,scheme,ppl_qdq,decode_tok_s,decode_tok_s_band,ttft_ms,speed_source",
                 "--name", "what_if", "--out-dir", str(out)]) == 0
    text = (out / "what_if.md").read_text()
    assert "what-if SM8750" in text and "--speed-estimate SM8750" in text
    import pandas as pd

    data = pd.read_csv(out / "what_if.csv")
    row = data[data["run_id"] == result.run_id].iloc[0]
    shapes = Shapes.of({"n_layers": 2, "dim": 64, "hidden_dim": 128, "n_heads": 4, "n_kv_heads": 2,
                        "vocab_size": 512})
    expected = estimate_config(shapes, quant_config("16a4w"), "SM8750", 64, 32, 32)[0]
    assert row["decode_tok_s"] == pytest.approx(expected.decode_tok_s, rel=1e-6)
    # the estimate's interval beside it
    assert f"[{expected.decode_low:.0f}, {expected.decode_high:.0f}]" in text and "10-90% band (est.)" in text
    assert main(["--experiment", "speed_what_if", "--tracking-uri", store_uri, "--speed-estimate", "SM8550",
                 "--out-dir", str(out)]) == 2
