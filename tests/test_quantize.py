"""Quantize stage on the tiny model: every scheme with both observers, recipes, overrides, caching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import TINY
from qexp.cache import Cache
from qexp.data.calibration import build_calibration
from qexp.core.config import QDQ_ONLY_SCHEMES, SCHEMES
from qexp.data.windows import make_windows
from qexp.eval.compare import sqnr_db
from qexp.eval.perplexity import evaluate
from qexp.quant.calibrate import quantize
from qexp.quant.encodings import encodings_table
from qexp.models.static_llama import StaticLlama, window_logits

CONTEXT = 64


@pytest.fixture(scope="module")
def setup(tiny_model, corpus, compose):
    cfg = compose(TINY)
    static = StaticLlama(tiny_model, CONTEXT)
    calibration = build_calibration(cfg.calibration, corpus, tiny_model.tokenizer, True, CONTEXT)
    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, CONTEXT, 2, True)
    fp = evaluate(lambda ids: window_logits(static.module, static, ids), windows, "fp", keep_logits=2)
    return static, calibration, windows, fp


def _quantize(setup, compose, tmp_path, overrides):
    static, calibration, windows, fp = setup
    cfg = compose(TINY + overrides)
    result = quantize(static, cfg.quant, cfg.observer, calibration, Cache(tmp_path), key="k", soc="SM8650")
    qdq = evaluate(lambda ids: window_logits(result.module, static, ids), windows, "qdq", keep_logits=2)
    return result, qdq, encodings_table(result.module)


EXPECTED_BITS = {  # scheme -> (activation bits, conv weight bits)
    "8a8w": (8, 8), "16a16w": (16, 16), "16a8w": (16, 8), "16a4w": (16, 4), "16a4w_block": (16, 4), "8a4w": (8, 4),
    "16a3w": (16, 3), "16a3w_block": (16, 3),  # QDQ-only research schemes: 4-bit recipes narrowed to [-3, 3]
    "16a2w": (16, 2), "fp16a8w": (None, 8),  # fp16a8w: float activations, no activation encodings
}


@pytest.mark.parametrize("scheme, observer", [
    (scheme, observer) for scheme in SCHEMES for observer in ("minmax", "moving_average")
    if not (scheme in QDQ_ONLY_SCHEMES and observer == "moving_average")  # 3-bit: the grid, not the observer, is new
])
def test_every_scheme_and_observer(setup, compose, tmp_path, scheme, observer):
    static, calibration, windows, fp = setup
    result, qdq, table = _quantize(setup, compose, tmp_path, [f"quant={scheme}", f"observer={observer}"])
    # the cold program (converted from the graph just calibrated) is the warm one (a fresh graph, the statistics
    # loaded from the cache), bit for bit
    cfg = compose(TINY + [f"quant={scheme}", f"observer={observer}"])
    warm = quantize(static, cfg.quant, cfg.observer, calibration, Cache(tmp_path), key="k", soc="SM8650")
    assert not result.cache_hit and warm.cache_hit
    assert torch.equal(window_logits(result.module, static, windows.ids[0]),
                       window_logits(warm.module, static, windows.ids[0]))
    act_bits, weight_bits = EXPECTED_BITS[scheme]
    activations, weights = table[~table["weight"]], table[table["weight"]]
    if act_bits is None:
        assert activations.empty, activations[["module", "bits"]]
    else:
        assert act_bits in set(activations["bits"]), activations["bits"].value_counts()
    # the decoder layers' projection weights carry the scheme's weight bits
    layer_weights = weights[weights["module"].str.match(r"layers\.\d+\..*_conv$")]
    assert len(layer_weights) == 7 * 2  # q, k, v, o, w1, w2, w3 in each of the two layers
    assert set(layer_weights["bits"]) == {weight_bits}, layer_weights[["module", "bits"]]
    if scheme.endswith("_block"):
        assert "per_block" in set(layer_weights["granularity"])
    elif scheme == "16a16w":
        assert set(layer_weights["granularity"]) == {"per_tensor"}
    else:
        assert set(layer_weights["granularity"]) == {"per_channel"}
    metrics = qdq.metrics()
    assert np.isfinite(metrics["ppl"])
    assert not np.allclose(qdq.logprobs, fp.logprobs)  # quantization did something
    # ... and the result still tracks the FP model (3-bit weights track it less: ~3.3 dB on this random model; 2-bit
    # weights of a random model do not track it: about -1 dB)
    if weight_bits >= 3:
        assert sqnr_db(fp.logits[0], qdq.logits[0]) > (2 if weight_bits == 3 else 3)
    if scheme == "16a2w":  # QnnQuantizer's 2-bit codes: [-2, 1], so a channel's range is [-2 scale, scale]
        ranges = layer_weights["range_min"] / layer_weights["range_max"]
        assert np.allclose(ranges, -2.0), ranges


def test_more_bits_is_closer_to_fp(setup, compose, tmp_path):
    static, calibration, windows, fp = setup
    sqnr = {}
    for scheme in ("16a16w", "8a4w"):
        _, qdq, _ = _quantize(setup, compose, tmp_path / scheme, [f"quant={scheme}"])
        sqnr[scheme] = np.mean([sqnr_db(a, b) for a, b in zip(fp.logits, qdq.logits)])
    assert sqnr["16a16w"] > sqnr["8a4w"] + 10, sqnr


def test_observers_give_different_ranges(setup, compose, tmp_path):
    tables = {}
    for observer in ("minmax", "moving_average", "percentile"):
        _, _, table = _quantize(setup, compose, tmp_path / observer, ["quant=8a8w", f"observer={observer}"])
        activations = table[~table["weight"]].set_index("tensor")
        # the covered width is max(max, 0) - min(min, 0) exactly (no zero-point rounding)
        tables[observer] = activations["range_max"] - activations["range_min"]
    minmax = tables["minmax"]
    for other in ("moving_average", "percentile"):
        common = minmax.index.intersection(tables[other].index)
        assert len(common) > 10
        # neither widens a range beyond the observed min/max (averages / percentiles of the same batches), and both
        # narrow some
        assert (tables[other][common] <= minmax[common] * (1 + 1e-3) + 1e-6).all()
        assert (tables[other][common] < minmax[common] * 0.999).any()


def test_override_by_layer_pattern(setup, compose, tmp_path):
    overrides = ["quant=16a4w", "quant.custom_annotations=[]",
                 "quant.overrides=[{pattern: 'layers\\.0\\.feed_forward', scheme: 16a8w}]"]
    _, _, table = _quantize(setup, compose, tmp_path, overrides)
    weights = table[table["weight"] & table["module"].str.match(r"layers\.\d+\..*_conv$")]
    ffn0 = weights[weights["module"].str.startswith("layers.0.feed_forward")]
    rest = weights[~weights["module"].str.startswith("layers.0.feed_forward")]
    assert len(ffn0) and set(ffn0["bits"]) == {8}
    assert set(rest["bits"]) == {4}


def test_block_size_is_configurable(setup, compose, tmp_path):
    counts = {}
    for block in (16, 32):
        _, _, table = _quantize(setup, compose, tmp_path / str(block),
                                ["quant=16a4w_block", f"quant.block_size={block}"])
        blocked = table[table["granularity"] == "per_block"]
        counts[block] = blocked["n_scales"].sum()
    assert counts[16] == 2 * counts[32]


def test_converted_program_is_cached(setup, compose, tmp_path):
    static, calibration, windows, fp = setup
    cfg = compose(TINY + ["quant=8a8w"])
    first = quantize(static, cfg.quant, cfg.observer, calibration, Cache(tmp_path), key="same", soc="SM8650")
    second = quantize(static, cfg.quant, cfg.observer, calibration, Cache(tmp_path), key="same", soc="SM8650")
    assert not first.cache_hit and second.cache_hit and first.stats_path.exists()
    observers = torch.load(first.stats_path, weights_only=True)
    assert sum("min_val" in o["state"] for o in observers.values()) > 50
    ids = windows.ids[0]
    assert torch.equal(window_logits(first.module, static, ids), window_logits(second.module, static, ids))


@pytest.mark.parametrize("scheme", ["16a4w", "16a4w_block"])
def test_full_4bit_weight_range(setup, compose, tmp_path, scheme):
    """quant.weight_range=full (the Q4_0 ablation): the decoder's 4-bit weights use [-8, 7] with scale absmax / 7.5,
    so -8 occurs; the 8-bit lm head keeps its range."""
    result, _, _ = _quantize(setup, compose, tmp_path, [f"quant={scheme}", "quant.weight_range=full"])
    module = result.module
    ranges, low_used = [], 0
    for node in module.graph.nodes:
        if node.op != "call_function" or not ("dequantize_per_channel" in str(node.target)
                                              or "dequantize_affine" in str(node.target)):
            continue
        qmin, qmax = node.args[4:6] if "per_channel" in str(node.target) else node.args[5:7]
        ranges.append((qmin, qmax))
        if (qmin, qmax) == (-8, 7):
            low_used += int((getattr(module, node.args[0].target) == -8).any())
    assert ranges.count((-8, 7)) == 14 and (-7, 7) not in ranges, ranges  # q, k, v, o, w1, w2, w3 x 2 layers
    assert any(qmax == 127 for _, qmax in ranges)  # the lm head (16a8w override) keeps 8 bits
    assert low_used == 14  # each layer has a weight at -8 (its row's most negative absmax lands there)


@pytest.mark.parametrize("scheme", ["16a4w", "16a4w_block", "16a8w", "16a16w"])
def test_converting_in_row_chunks_gives_convert_pt2es_program(setup, compose, tmp_path, monkeypatch, scheme):
    """The QDQ program folds its weights' quantize ops a few rows at a time (no full-size float temporaries): with
    8 rows per chunk, so every weight of the tiny model is split, its integer weights and outputs equal torchao's
    convert_pt2e's, per tensor (the embedding), per channel, per block (LPBQ)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    from qexp.quant.calibrate import OBSERVERS, load_observer_statistics, prepare
    from qexp.core.timing import StageTimer
    from qexp.upstream import private_quantize

    static, calibration, windows, _ = setup
    cfg = compose(TINY + [f"quant={scheme}"])
    monkeypatch.setattr(private_quantize, "ROWS_PER_CHUNK", 8)
    chunked = quantize(static, cfg.quant, cfg.observer, calibration, Cache(tmp_path), key="k", soc="SM8650")
    with torch.no_grad():
        prepared = prepare(static, cfg.quant, cfg.observer, "SM8650", True, StageTimer())
        load_observer_statistics(prepared, torch.load(chunked.stats_path, weights_only=True))
        whole = convert_pt2e(prepared)
    assert chunked.stats_path.name == OBSERVERS

    def integers(module):
        return {n: t for n, t in module.named_buffers() if n.startswith("_frozen_param")}

    ours, theirs = integers(chunked.module), integers(whole)
    assert ours.keys() == theirs.keys() and len(ours) >= 14
    assert any(t.shape[0] > 8 for t in ours.values())  # split into chunks
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    ids = windows.ids[0]
    assert torch.equal(window_logits(chunked.module, static, ids), window_logits(whole, static, ids))
