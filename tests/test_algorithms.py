"""Quantization algorithms (qexp/transforms, qexp/transforms/seq_mse.py) on the tiny model and on synthetic layers:
each against its paper's definition, against the QNN grid QnnQuantizer really uses, composed, cached, and refused
where it cannot serve the config."""

from __future__ import annotations



import pytest
import torch

from helpers import TINY, program_weights
from qexp.core.errors import ConfigError
from qexp.pipeline import prepare, run_experiment, validate
from qexp.core.timing import StageTimer
from qexp.transforms import TransformContext, apply_transforms, build_transforms
from qexp.transforms.awq import awq_loss, search_scale
from qexp.models.shapes import static_module_path
from qexp.quant.grid import WeightGrid, grid_for, layer_linears
from qexp.transforms.gptq import gptq_quantize, hessian
from qexp.transforms.smoothquant import smoothing_scales
from qexp.transforms.weight_clip import mse_scales


# ------------------------------------------------------------------ helpers
def transformed(compose, overrides, through="calibration"):
    cfg = compose(TINY + overrides)
    state = prepare(cfg, through=through)
    context = TransformContext(cfg, state.calibration, state.cache, StageTimer())
    return state, apply_transforms(state.model, build_transforms(cfg.algorithm), context), context


def float_logits(model, windows, context_len=64):
    from qexp.models.static_llama import StaticLlama, window_logits

    static = StaticLlama(model, context_len)
    return torch.cat([window_logits(static.module, static, row.tolist()) for row in windows.ids[:2]])


def sqnr_db(ref, x):
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


# ------------------------------------------------------------------ the grid
def test_grid_is_qnnquantizers_grid(compose):
    """Fake-quantizing the Meta weights with grid_for(...) gives exactly the converted QDQ program's weights:
    4-bit per channel, 3-bit per block and the 8-bit lm-head override."""
    for quant in (["quant=16a4w"], ["quant=16a3w_block", "quant.block_size=16"]):
        state = prepare(compose(TINY + quant), through="qdq")
        weights = program_weights(state.qdq.program.module)
        model, static = state.model, state.deploy_static
        checked = 0
        for key in layer_linears(0) + ["output.weight"]:
            name, expected_rows = static.static_layout(key,
                                                       grid_for(state.cfg.quant, key).quantize(model.state_dict[key]))
            ints, scale = weights[name]
            scale = scale.reshape(ints.shape[0], -1)
            got = (ints.reshape(ints.shape[0], -1).float()
                   * scale.repeat_interleave(ints.reshape(ints.shape[0], -1).shape[1] // scale.shape[1], 1))
            assert torch.allclose(got, expected_rows, rtol=0, atol=1e-6), (quant, key)
            checked += 1
        assert checked == 8
        if quant[0] == "quant=16a3w_block":
            assert int(weights["layers.0.attention.wq_conv.weight"][0].abs().max()) == 3


def test_static_module_paths():
    assert static_module_path("layers.3.attention.wq.weight") == "layers.3.attention.wq_conv"
    assert static_module_path("layers.0.feed_forward.w2.weight") == "layers.0.feed_forward.w2_conv"
    assert static_module_path("output.weight") == "output.conv"
    assert WeightGrid(4).qmax == 7 and WeightGrid(3).qmax == 3 and WeightGrid(8).qmax == 127


# ------------------------------------------------------------------ AWQ (paper: s* = argmin ||Q(W s)(X/s) - WX||)
def _outlier_layer(seed=0, out=48, cols=64, tokens=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g)
    x[:, :4] *= 20  # a few salient input channels, the case AWQ exists for
    w = torch.randn(out, cols, generator=g) * 0.05
    return w, x


def test_awq_scale_is_the_grid_argmin_of_the_papers_objective():
    w, x = _outlier_layer()
    grid = WeightGrid(4, 16)
    s = search_scale([w], [grid], x, n_grid=20, duo_scaling=False)
    reference = [x @ w.T]
    # brute force over the same candidate set: s = s_X^a normalised, a in {0, 1/20, ...}
    x_mean = x.abs().mean(0)
    candidates = [torch.ones_like(x_mean)]
    for step in range(20):
        c = x_mean.pow(step / 20).clamp(min=1e-4)
        candidates.append(c / (c.max() * c.min()).sqrt())
    losses = [awq_loss([w], [grid], x, c, reference) for c in candidates]
    assert awq_loss([w], [grid], x, s, reference) == pytest.approx(min(losses), rel=1e-9)
    assert min(losses) < losses[0] * 0.8  # it beats round-to-nearest (s = 1) clearly on salient channels


def test_awq_without_clipping_keeps_the_float_function_and_composes_with_rotation(compose):
    state, model, _ = transformed(compose, ["quant=16a4w", "+algorithm.rotation={}",
                                            "+algorithm.awq={clip: false}"])
    assert model.transforms == ("rotation", "awq")
    ref, got = float_logits(state.model, state.windows), float_logits(model, state.windows)
    assert (ref - got).abs().max() < 1e-3 and sqnr_db(ref, got) > 80
    changed = [k for k in layer_linears(0) if not torch.equal(model.state_dict[k], state.model.state_dict[k])]
    assert len(changed) == 7


# ------------------------------------------------------------------ GPTQ (paper: Algorithm 1)
def test_gptq_equals_rtn_for_uncorrelated_inputs_and_beats_it_otherwise():
    w, x = _outlier_layer(1)
    grid = WeightGrid(4)
    q, scales = gptq_quantize(w, torch.eye(w.shape[1]), grid, damp=0.0)
    assert torch.equal(q, grid.quantize(w))  # H = I: nothing to compensate
    assert torch.allclose(scales, grid.scales(w))
    g = torch.Generator().manual_seed(2)
    mix = torch.randn(w.shape[1], w.shape[1], generator=g) * 0.3 + torch.eye(w.shape[1])
    xc = x @ mix  # correlated inputs
    for act_order in (False, True):
        for block in (None, 16):
            grid = WeightGrid(4, block)
            q, scales = gptq_quantize(w, hessian(xc), grid, act_order=act_order, block_size=32)
            rtn = grid.quantize(w)
            assert ((xc @ (q - w).T).norm() < 0.9 * (xc @ (rtn - w).T).norm())
            ints = q / grid.expand(scales, w.shape[1])
            assert torch.allclose(ints, ints.round(), atol=1e-4) and ints.abs().max() <= 7 + 1e-4


def test_gptq_dynamic_block_scales_stay_on_the_lpbq_grid_and_avoid_the_static_clipping():
    """Per-block GPTQ chooses each block's scale when it reaches the block (the reference's groupsize mode). The
    scales stay HTP's LPBQ encoding: 4-bit multiples of the row's original unit, the largest exactly 16 units, so
    ExecuTorch's re-encoding at lowering is the identity; and on correlated inputs the output error is no worse than
    with scales fixed from the original weights, whose clipped updates cascade."""
    from qexp.quant.lpbq import SCALE_STEPS, quantize_block_scales

    w, x = _outlier_layer(3, out=32, cols=128)
    g = torch.Generator().manual_seed(4)
    xc = x @ (torch.randn(128, 128, generator=g) * 0.3 + torch.eye(128))
    grid = WeightGrid(4, 32)
    unit = grid.scales(w).amax(-1, keepdim=True) / SCALE_STEPS
    dynamic, d_scales = gptq_quantize(w, hessian(xc), grid)
    static, s_scales = gptq_quantize(w, hessian(xc), grid, static_groups=True)
    assert not torch.equal(d_scales, s_scales)  # some block scale did follow the updates
    steps = d_scales / unit
    assert torch.allclose(steps, steps.round(), atol=1e-5) and steps.min() >= 1 - 1e-5
    assert torch.allclose(steps.amax(-1), torch.full((32,), float(SCALE_STEPS)), atol=1e-5)
    assert torch.allclose(quantize_block_scales(d_scales, grid.block_scale_rounding), d_scales, rtol=1e-6)
    ints = dynamic / grid.expand(d_scales, 128)
    assert torch.allclose(ints, ints.round(), atol=1e-4) and ints.abs().max() <= 7 + 1e-4
    error = lambda q: float((xc @ (q - w).T).norm())  # noqa: E731
    print(f"output error: dynamic {error(dynamic):.4f} static {error(static):.4f} rtn {error(grid.quantize(w)):.4f}")
    assert error(dynamic) <= error(static) * 1.02 and error(dynamic) < error(grid.quantize(w))


def test_gptq_integers_reach_the_qdq_program_exactly(compose):
    """GPTQ's scales are handed to QnnQuantizer: the converted program's integers are GPTQ's, also for rows whose
    GPTQ weights never reach +-7 (QnnQuantizer's own observer would shrink their scale)."""
    short_groups = 0
    for quant in (["quant=16a4w"], ["quant=16a4w_block", "quant.block_size=16"]):
        state = prepare(compose(TINY + quant + ["+algorithm.rotation={}", "+algorithm.gptq={}"]), through="qdq")
        model, static = state.deploy_model, state.deploy_static
        weights = program_weights(state.qdq.program.module)
        for key in layer_linears(1):
            grid = grid_for(state.cfg.quant, key)
            name, ranges = static.static_layout(key, model.weight_ranges[key])
            _, expected = static.static_layout(key, model.state_dict[key])
            scales = grid.expand(ranges / grid.qmax, expected.shape[1])
            expected_ints = torch.round(expected / scales)
            ints, _ = weights[name]
            assert torch.equal(ints.reshape(expected_ints.shape).float(), expected_ints), (quant, key)
            groups = expected_ints.reshape(expected_ints.shape[0], ranges.shape[1], -1)
            short_groups += int((groups.abs().amax(-1) < grid.qmax).sum())
    assert short_groups > 0  # the case the handover exists for (a row/block never reaching +-qmax) does occur


# ------------------------------------------------------------------ weight clipping (GPTQ reference, mse=True)
def reference_mse_scales(w, qmax, grid=100, maxshrink=0.8, norm=2.4):
    """gptq/quant.py Quantizer.find_params with sym=True, perchannel=True, mse=True, transcribed, on QNN's grid: the
    range [-max, max] shrunk by p = 1 - i / grid for i < maxshrink * grid, the error sum |Q(w) - w|^norm per row, the
    first best kept. Only the grid is QNN's: ints in [-qmax, qmax] with scale p max / qmax, where the reference has
    [0, 2^b - 1] with zero point 2^(b-1) and scale 2 p max / (2^b - 1)."""
    xmax = w.abs().amax(1)
    best = torch.full([w.shape[0]], float("inf"))
    scale = torch.zeros_like(xmax)
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        scale1 = p * xmax / qmax
        q = torch.clamp(torch.round(w / scale1[:, None]), -qmax, qmax) * scale1[:, None]
        err = (q - w).abs().pow(norm).sum(1)
        tmp = err < best
        best[tmp], scale[tmp] = err[tmp], scale1[tmp]
    return scale


def test_weight_clip_is_the_gptq_references_mse_search_on_the_qnn_grid():
    from qexp.quant.lpbq import SCALE_STEPS, quantize_block_scales

    w, x = _outlier_layer(5, out=32, cols=128)
    per_channel = WeightGrid(4)
    got = mse_scales(w, per_channel)
    assert torch.allclose(got[:, 0], reference_mse_scales(w, 7), rtol=1e-6)
    err = lambda q: (q - w).abs().pow(2.4).sum(1)  # noqa: E731
    assert (err(per_channel.quantize(w, got)) <= err(per_channel.quantize(w)) + 1e-6).all()
    assert (got[:, 0] < per_channel.scales(w)[:, 0]).any()  # some rows are clipped
    # LPBQ blocks: the scales are the row's 4-bit steps of its unit, the largest block keeps 16, so the lowering's
    # re-encoding is the identity; per block the error is the best of those steps
    block = WeightGrid(4, 32)
    got = mse_scales(w, block)
    unit = block.scales(w).amax(-1, keepdim=True) / SCALE_STEPS
    steps = got / unit
    assert torch.allclose(steps, steps.round(), atol=1e-5) and steps.min() >= 1 - 1e-5
    assert torch.allclose(steps.amax(-1), torch.full((32,), float(SCALE_STEPS)), atol=1e-5)
    assert torch.allclose(quantize_block_scales(got, block.block_scale_rounding), got, rtol=1e-6)
    blockwise = lambda q: (q - w).abs().pow(2.4).reshape(32, 4, 32).sum(-1)  # noqa: E731
    assert (blockwise(block.quantize(w, got)) <= blockwise(block.quantize(w)) + 1e-6).all()
    assert (got < block.scales(w) - 1e-9).any()
    # GPTQ after weight_clip rounds onto exactly these scales, in every mode
    xc = x @ (torch.randn(128, 128, generator=torch.Generator().manual_seed(6)) * 0.3 + torch.eye(128))
    for act_order in (False, True):
        q, scales = gptq_quantize(w, hessian(xc), block, act_order=act_order, scales=got)
        assert torch.equal(scales, got)
        ints = q / block.expand(got, 128)
        assert torch.allclose(ints, ints.round(), atol=1e-4) and ints.abs().max() <= 7 + 1e-4


def test_weight_clip_outputs_objective_is_the_least_output_error_candidate():
    """objective=outputs: per row (per channel) and per block, the chosen scale is the candidate whose quantized
    weights give the least output error sum_t ((Q(w) - w) . x_t)^2 on the given inputs, evaluated directly (no H);
    with an outlier input channel it differs from the weights' own choice and lowers the output error."""
    from qexp.transforms.weight_clip import block_gram, clip_candidates, output_mse_scales

    w, x = _outlier_layer(5, out=32, cols=128)
    for grid in (WeightGrid(4), WeightGrid(4, 32)):
        size = grid.block_size or 128
        got = output_mse_scales(w, block_gram(x, size), grid)
        blocks = 128 // size
        wb = w.reshape(32, blocks, size).transpose(0, 1)
        original_max = wb.abs().amax(-1, keepdim=True)
        errors, scales = [], []
        for _, scale in clip_candidates(original_max, grid, 100, 0.8):
            d = torch.clamp(torch.round(wb / scale), -grid.qmax, grid.qmax) * scale - wb  # [blocks, out, size]
            partial = torch.einsum("bos,tbs->bot", d, x.reshape(-1, blocks, size))
            errors.append(partial.pow(2).sum(-1))
            scales.append(scale.squeeze(-1))
        errors, scales = torch.stack(errors), torch.stack(scales)  # [candidates, blocks, out]
        best = errors.argmin(0, keepdim=True)
        expected = scales.gather(0, best)[0].transpose(0, 1)
        chosen = (scales - got.transpose(0, 1)).abs().argmin(0, keepdim=True)
        # the chosen candidate's error equals the least one (ties between equal candidates may pick either)
        assert torch.allclose(errors.gather(0, chosen), errors.gather(0, best), rtol=1e-4), grid.describe()
        output_error = lambda sc: float(((grid.quantize(w, sc) - w) @ x.T).pow(2).sum())  # noqa: E731
        assert output_error(got) <= output_error(grid.scales(w)) * (1 + 1e-5)
        if not grid.block_size:
            assert torch.allclose(got, expected, rtol=1e-5)
            assert output_error(got) < output_error(mse_scales(w, grid))
            assert not torch.allclose(got, mse_scales(w, grid))


@pytest.mark.parametrize("algorithm, extra", [
    ("[weight_clip]", []), ("[rotation,weight_clip,gptq]", []),
    ("[weight_clip]", ["algorithm.weight_clip.objective=outputs"]),  # judged on outputs: needs the calibration data
])
def test_searched_scales_reach_the_qdq_program_exactly(compose, algorithm, extra):
    """weight_clip's scales (also when GPTQ rounds onto them) are the converted program's: its integers are
    round(w / scale) with them, and some are below QnnQuantizer's own absmax scales."""
    for quant in (["quant=16a4w"], ["quant=16a4w_block", "quant.block_size=16"]):
        state = prepare(compose(TINY + quant + [f"algorithm={algorithm}", *extra]), through="qdq")
        model, static = state.deploy_model, state.deploy_static
        weights = program_weights(state.qdq.program.module)
        clipped = 0
        for key in layer_linears(1):
            grid = grid_for(state.cfg.quant, key)
            name, ranges = static.static_layout(key, model.weight_ranges[key])
            _, expected = static.static_layout(key, model.state_dict[key])
            scales = grid.expand(ranges / grid.qmax, expected.shape[1])
            expected_ints = torch.clamp(torch.round(expected / scales), -grid.qmax, grid.qmax)
            ints, _ = weights[name]
            assert torch.equal(ints.reshape(expected_ints.shape).float(), expected_ints), (quant, key)
            absmax = grid.scales(model.state_dict[key])
            clipped += int((ranges.reshape(absmax.shape) / grid.qmax < absmax * (1 - 1e-6)).sum())
        assert clipped > 0, quant


# ------------------------------------------------------------------ SmoothQuant (paper Eq. 4)
def test_smoothquant_scales_and_function(compose):
    x_absmax, w = torch.tensor([8.0, 1.0, 0.5]), torch.tensor([[1.0, 2.0, 4.0]])
    s = smoothing_scales(x_absmax, [w], alpha=0.5)
    assert torch.allclose(s, (x_absmax.sqrt() / w.abs().amax(0).sqrt()))
    state, model, _ = transformed(compose, ["quant=8a8w", "+algorithm.smoothquant={alpha: 0.5}"])
    ref, got = float_logits(state.model, state.windows), float_logits(model, state.windows)
    assert sqnr_db(ref, got) > 80
    assert not torch.equal(model.state_dict["layers.0.attention_norm.weight"],
                           state.model.state_dict["layers.0.attention_norm.weight"])


def test_rotation_keeps_the_float_function(compose):
    state, model, _ = transformed(compose, ["quant=16a4w", "+algorithm.rotation={seed: 3}"])
    ref, got = float_logits(state.model, state.windows), float_logits(model, state.windows)
    assert sqnr_db(ref, got) > 80
    # R1 reached the embedding and the (now untied) lm head; the norms were folded into the linears
    assert not torch.allclose(model.state_dict["tok_embeddings.weight"],
                              state.model.state_dict["tok_embeddings.weight"])
    assert torch.equal(model.state_dict["norm.weight"], torch.ones_like(model.state_dict["norm.weight"]))


# ------------------------------------------------------------------ SeqMSE (ExecuTorch's pass)
def test_seq_mse_scales_reach_the_program_and_the_deploy_graphs(compose):
    from qexp.backends.htp.graph import quantized_graph

    plain = prepare(compose(TINY + ["quant=16a4w"]), through="qdq")
    searched = prepare(compose(TINY + ["quant=16a4w", "+algorithm.seq_mse={candidates: 20}"]), through="qdq")
    assert searched.qdq.program.key != plain.qdq.program.key
    a, b = program_weights(plain.qdq.program.module), program_weights(searched.qdq.program.module)
    ratios = {name: float((b[name][1].reshape(-1) / a[name][1].reshape(-1)).mean()) for name in a}
    assert any(r < 0.999 for r in ratios.values())  # some layer's scale was shrunk
    assert all(r <= 1.0 + 1e-6 for r in ratios.values())
    # a kv graph (another AR length) quantized from the saved statistics gets the same searched scales
    stats = torch.load(searched.qdq.program.stats_path, weights_only=True)
    cfg = searched.cfg
    converted, _ = quantized_graph(searched.deploy_model, 64, 1, searched.deploy_static.r3, cfg.quant, cfg.observer,
                                   stats, cfg.model.recompose_hadamard, "SM8650")
    c = program_weights(converted)
    for name in b:
        assert torch.equal(c[name][0], b[name][0]) and torch.allclose(c[name][1], b[name][1]), name


# ------------------------------------------------------------------ cache, composition, the run
def test_expensive_transforms_are_cached_by_model_settings_calibration_and_grid(compose):
    _, first, c1 = transformed(compose, ["quant=16a4w", "+algorithm.gptq={damp: 0.02}"])
    _, again, c2 = transformed(compose, ["quant=16a4w", "+algorithm.gptq={damp: 0.02}"])
    _, other_grid, c3 = transformed(compose, ["quant=16a4w_block", "quant.block_size=16",
                                              "+algorithm.gptq={damp: 0.02}"])
    assert c2.cache_hits["gptq"] and not c3.cache_hits["gptq"]
    assert again.fingerprint == first.fingerprint != other_grid.fingerprint
    for key in first.state_dict:
        assert torch.equal(first.state_dict[key], again.state_dict[key])
    for key in first.weight_ranges:
        assert torch.equal(first.weight_ranges[key], again.weight_ranges[key])


def test_awq_run_logs_the_transformed_float_model_and_beats_rtn_on_logits(compose):
    # per channel: the tiny random model has no outlier channels, and at block 16 with LPBQ scales AWQ's gain on it
    # is within noise (+-0.5 dB either way); per channel it is +0.8 dB. SmolLM2's gains are in results/algorithms.md.
    rtn = run_experiment(compose(TINY + ["quant=16a4w"])).metrics
    result = run_experiment(compose(TINY + ["quant=16a4w", "algorithm=[awq]"]))
    m = result.metrics
    assert "ppl_fp_transformed" in m and result.tags["algorithm"] == "awq"
    assert m["logits_sqnr_db_qdq_vs_fp"] > rtn["logits_sqnr_db_qdq_vs_fp"]


def test_algorithm_label_names_the_settings_that_differ_from_the_defaults():
    """The `algorithm` tag (and so every table's algorithm column) tells runs of one algorithm with other settings
    apart, and keeps the bare name at the defaults (the label earlier runs carry)."""
    from omegaconf import OmegaConf

    from qexp.transforms import algorithm_label

    label = lambda a: algorithm_label(build_transforms(OmegaConf.create(a)))  # noqa: E731
    assert label({}) == ""
    assert label({"rotation": {}, "weight_clip": {}, "gptq": {}}) == "rotation,weight_clip,gptq"
    assert label({"weight_clip": {"objective": "weights"}, "gptq": {"damp": 0.01}}) == "weight_clip,gptq"
    assert label({"weight_clip": {"objective": "outputs"}, "gptq": {"damp": 0.1, "act_order": False}}) == \
        "weight_clip(objective=outputs),gptq(damp=0.1 act_order=false)"


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("overrides, message", [
    (["quant=16a4w", "algorithm=[smoothquant]"], "smoothquant smooths 8-bit activations"),
    # an 8-bit override on a linear it does not smooth (down) leaves the ones it does at 16 bits
    (["quant=16a8w", "algorithm=[smoothquant]",
      "+quant.overrides=[{pattern: 'layers\\.\\d+\\.feed_forward\\.w2_conv', scheme: 8a8w}]"],
     "smoothquant smooths 8-bit activations"),
    (["quant=fp32", "algorithm=[gptq]"], "gptq rounds weights onto a quantization grid"),
    (["quant=fp32", "algorithm=[awq]"], "awq searches against a quantization grid"),
    (["quant=16a3w", "backend=htp"], "QDQ-only research scheme"),
    (["quant=16a4w", "+algorithm.awq={n_grids: 3}"], "algorithm.awq"),
    (["quant=16a4w", "algorithm=[seq_mse]", "quant.weight_granularity=per_tensor"], "per-channel or per-block"),
    (["quant=16a4w", "algorithm=[weight_clip,rotation]"], "rotation after weight_clip would not keep"),
    (["quant=16a4w", "algorithm=[gptq,awq]"], "awq after gptq would not keep"),
    (["quant=16a4w", "algorithm=[weight_clip]", "algorithm.weight_clip.objective=activations"],
     "algorithm.weight_clip.objective='activations'"),
    (["quant=16a4w", "algorithm=[gptq,seq_mse]"], "seq_mse searches weight scales, and gptq already fixed"),
])
def test_algorithms_refuse_configs_they_cannot_serve(compose, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(TINY + overrides))


def test_smoothquant_serves_8bit_overrides_on_the_linears_it_smooths(compose):
    """The paper's setting on a 16-bit-activation scheme: the smoothed linears' inputs at 8 bits by an override."""
    from qexp.quant.grid import activation_bits_for

    cfg = compose(TINY + ["quant=16a8w", "algorithm=[smoothquant]",
                          "+quant.overrides=[{pattern: 'layers\\.0\\.attention\\.wq_conv', scheme: 8a8w}]"])
    validate(cfg)
    assert activation_bits_for(cfg.quant, "layers.0.attention.wq.weight") == 8
    assert activation_bits_for(cfg.quant, "layers.1.attention.wq.weight") == 16


def test_bad_block_size_and_empty_calibration_fail_the_run_before_work(compose, tmp_path):
    from qexp.core.errors import InputError

    with pytest.raises((ConfigError, InputError), match="block_size=48 does not divide the 64 input channels"):
        run_experiment(compose(TINY + ["quant=16a4w_block", "quant.block_size=48", "algorithm=[awq]"]))
    own = tmp_path / "cache"  # a cache of its own: the session's is shared by the workers, who add entries at will
    with pytest.raises(ConfigError, match="calibration data is empty"):
        run_experiment(compose(TINY + ["quant=16a4w", "algorithm=[gptq]", "calibration.limit=0", f"cache_dir={own}"]))
    assert not list((own / "transform").glob("*"))  # no cache entry for a failed transform


@pytest.mark.parametrize("overrides,match", [
    (["quant=16a2w", "algorithm=[gptq]"], "asymmetric codes"),
    (["quant=16a2w", "algorithm=[weight_clip]"], "asymmetric codes"),
    (["quant=16a2w", "+algorithm.seq_mse={}"], "asymmetric codes"),
])
def test_two_bit_weights_refuse_the_grid_searches(compose, overrides, match):
    """The weight algorithms search symmetric grids; 16a2w's codes are [-2, 1]: one line before any work."""
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match=match):
        validate(compose(TINY + overrides))
    validate(compose(TINY + ["quant=16a2w", "algorithm=[rotation]"]))  # a rotation does not search a grid
