"""eval.htp_exact (qexp/quant/htp_arithmetic.py): HTP's integer arithmetic for 16-bit-activation layers, checked
against an int64 reference of its definition, against the fake-quant program it replaces, and end to end.
Whether it matches the HTP emulator is measured by diagnostics/diag_htp_weight_bits.py (slow, x86 HTP emulator)."""

from __future__ import annotations

import pytest
import torch

from helpers import REPO, TINY
from qexp.models.static_llama import window_logits
from qexp.pipeline import prepare
from qexp.quant.fold import with_weights_dequantized
from qexp.quant.htp_arithmetic import (
    htp_accumulate,
    htp_conv1x1,
    htp_integer_weights,
    quantize_per_tensor_floor,
)
from qexp.quant.htp_arithmetic_pass import MODELLED_OPS
from qexp.quant.lpbq import quantize_block_scales
from qexp.core.config import BlockScaleRounding


def _int64_reference(x_q, zp, w):
    """The definition in integers: floor(sum w (x_q - 32768) / 256) * 256 + round((32768 - zp) sum w / 256) * 256."""
    acc = (x_q.long() - 32768) @ w.long().T
    truncated = torch.div(acc, 256, rounding_mode="floor") * 256
    correction = torch.round((32768 - zp) * w.long().sum(dim=1).double() / 256).long() * 256
    return truncated + correction


@pytest.mark.parametrize("channels, w_max", [(64, 7), (1536, 127), (4096, 112)])
def test_accumulator_is_exact_and_floors(channels, w_max):
    generator = torch.Generator().manual_seed(channels)
    x_q = torch.randint(0, 65536, (5, channels), generator=generator)
    w = torch.randint(-w_max, w_max + 1, (48, channels), generator=generator)
    got = htp_accumulate(x_q, 29932, w.double())
    assert torch.equal(got.long(), _int64_reference(x_q, 29932, w))
    # the floor is a bias: against the exact accumulator, the error is in (-256, 0], never positive
    exact = (x_q.long() - 32768) @ w.long().T
    dropped = torch.div(exact, 256, rounding_mode="floor") * 256 - exact
    assert bool((dropped <= 0).all()) and bool((dropped > -256).all()) and bool((dropped < 0).any())


def test_block_weights_are_the_lpbq_encoding():
    """unit * w equals the dequantized weight when the block scales are LPBQ-representable (block_scale_rounding
    nearest), and w is what ExecuTorch encodes: w_q times the 4-bit step of the block."""
    generator = torch.Generator().manual_seed(0)
    scales = quantize_block_scales(torch.rand(8, 4, generator=generator) + 0.05, BlockScaleRounding.nearest)
    w_q = torch.randint(-7, 8, (8, 128), generator=generator)
    w, unit = htp_integer_weights(w_q, scales, "block", lpbq_per_channel=False)
    dequantized = w_q.double() * scales.double().repeat_interleave(32, dim=1)
    assert torch.allclose(w * unit[:, None], dequantized, rtol=1e-6, atol=0)
    assert torch.equal(w, w.round()) and w.abs().max() <= 7 * 16
    steps = (w / w_q.double().where(w_q != 0, torch.ones(1, dtype=torch.double)))[w_q != 0]
    assert steps.min() >= 1 and steps.max() <= 16


def test_per_channel_4bit_lpbq_lowering_is_16_steps_finer():
    w_q = torch.tensor([[3, -7], [1, 2]])
    scale = torch.tensor([0.5, 0.25])
    w, unit = htp_integer_weights(w_q, scale, "per_channel", lpbq_per_channel=True)
    assert torch.equal(w, 16 * w_q.double()) and torch.equal(unit, scale.double() / 16)
    w, unit = htp_integer_weights(w_q, scale, "per_channel", lpbq_per_channel=False)
    assert torch.equal(w, w_q.double()) and torch.equal(unit, scale.double())


def test_conv1x1_equals_the_fake_quant_layer_up_to_the_dropped_bits():
    """Without the truncation the integer layer is the fake-quant layer; with it, each output is lower by less than
    one accumulator unit (256 * s_x * unit) plus half a unit of the rounded correction."""
    generator = torch.Generator().manual_seed(1)
    x_q = torch.randint(0, 65536, (1, 96, 1, 7), generator=generator)
    w_q = torch.randint(-127, 128, (16, 96, 1, 1), generator=generator)
    scale, x_scale, zp = torch.rand(16, generator=generator) * 1e-2, 1e-4, 29932
    w, unit = htp_integer_weights(w_q, scale, "per_channel", lpbq_per_channel=False)
    got = htp_conv1x1(x_q, x_scale, zp, w, unit).double()
    fake = torch.nn.functional.conv2d(x_scale * (x_q.double() - zp), w_q.double() * scale.double()[:, None, None, None])
    step = (256 * x_scale * unit.double())[None, :, None, None]
    assert bool(((fake - got) > -0.5 * step - 1e-9).all()) and bool(((fake - got) < 1.5 * step + 1e-9).all())
    assert (fake - got).mean() > 0  # the floor's bias


def test_norm_quantize_floors_where_the_program_rounds():
    """quantize_per_tensor_floor is quantize_per_tensor with floor(x / s) for round(x / s): the same integers where
    the fraction is below one half, one less above it, clamped alike."""
    scale, zp = 2.0 ** -7, 30000  # a power of two: x / s is exact, so the fractions are the ones written
    steps = torch.tensor([0.0, 0.2, 0.49, 0.51, 0.8, -0.2, -0.8, 3e6, -3e6])
    x = (steps + torch.tensor([10.0] * 7 + [0.0, 0.0])) * scale
    got = quantize_per_tensor_floor(x, scale, zp, 0, 65535, torch.uint16).long()
    rounded = torch.ops.quantized_decomposed.quantize_per_tensor(x, scale, zp, 0, 65535, torch.uint16).long()
    assert got.tolist() == [30010, 30010, 30010, 30010, 30010, 30009, 30009, 65535, 0]
    assert (rounded - got).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("quant, modelled", [("16a4w_block", True), ("16a8w", True), ("8a8w", False)])
def test_program_pass_models_16bit_layers_only(quant, modelled, compose):
    state = prepare(compose(TINY + [f"quant={quant}"]), "qdq")
    program, static = state.qdq.program.module, state.qdq.static
    fake = with_weights_dequantized(program)
    exact = with_weights_dequantized(program, "lpbq")
    convs = sum(1 for n in program.graph.nodes if n.op == "call_function" and "conv2d" in str(n.target))
    ids = state.windows.ids[0].tolist()
    a, b = window_logits(fake, static, ids), window_logits(exact, static, ids)
    norms = sum(1 for n in program.graph.nodes if n.op == "call_function" and "rms_norm" in str(n.target))
    if not modelled:  # 8-bit activations: no measured model of HTP's kernel, the fake-quant arithmetic stays
        assert exact.htp_counts.modelled == 0 and exact.htp_counts.norms == 0 and torch.equal(a, b)
        assert exact.htp_counts.norms_kept == norms
        return
    assert exact.htp_counts.modelled == convs > 0 and exact.htp_counts.kept == 0
    assert exact.htp_counts.norms == norms == 5 and exact.htp_counts.norms_kept == 0  # model=tiny: 2 layers x 2 + 1
    assert not torch.equal(a, b)
    sqnr = 10 * torch.log10(a.pow(2).sum() / (a - b).pow(2).sum())
    assert sqnr > 20  # the same quantized model, computed a little differently
    integer = [n for n in program.graph.nodes if n.op == "get_attr"
               and getattr(program, n.target).dtype in (torch.int8, torch.int16, torch.int32)]
    assert integer  # the program is untouched: the pass works on the evaluation copy


def test_htp_exact_run_is_tagged_and_not_paired_with_fake_quant(compose):
    from qexp.report.paired import IDENTITY

    fake = prepare(compose(TINY + ["quant=16a4w"]), "qdq")
    exact = prepare(compose(TINY + ["quant=16a4w", "eval.htp_exact=true"]), "qdq")
    assert fake.tags["qdq_arithmetic"] == "fake_quant" and exact.tags["qdq_arithmetic"] == "htp_exact"
    assert exact.metrics["htp_exact_layers"] > 0 and "htp_exact_layers" not in fake.metrics
    assert exact.metrics["htp_exact_norms"] == 5 and exact.tags["htp_exact_model"] == MODELLED_OPS
    assert exact.metrics["htp_exact_softmaxes"] == exact.metrics["htp_exact_sigmoids"] == 2  # model=tiny: 2 layers
    assert exact.metrics["htp_exact_gelus"] == 0
    assert "htp_exact_model" not in fake.tags
    assert exact.metrics["ppl_qdq"] != fake.metrics["ppl_qdq"]
    assert exact.tags["qdq_cache_key"] == fake.tags["qdq_cache_key"]  # same quantization, only the arithmetic differs
    assert "qdq_arithmetic" in IDENTITY


def test_new_settings_at_their_default_keep_earlier_hashes(compose):
    """eval.htp_exact, quant.weight_range and model.masked_softmax came after runs and cache entries existed: at their
    defaults they are left out of the config hash (sweeps still skip finished runs) and the QDQ cache key; set, they
    count."""
    from omegaconf import OmegaConf

    from qexp.core.provenance import config_hash, stable_hash

    cfg = compose(TINY)
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for volatile in ("tracking", "cache_dir", "cache", "verbose", "device"):  # device: the CPU's leaves no trace
        container.pop(volatile, None)
    del container["eval"]["htp_exact"], container["quant"]["weight_range"], container["model"]["masked_softmax"]
    del container["model"]["tiny"]["config"]  # model.tiny.config came later too
    del container["sensitivity"], container["search"]  # None outside `python -m qexp.sensitivity` / `.search`
    for task_setting in ("tasks", "task_paths", "task_limit"):  # the tasks stage came later too
        del container["eval"][task_setting]
    assert config_hash(cfg) == stable_hash(container, length=16)
    assert config_hash(compose(TINY + ["eval.tasks=[qexp_lastword_wikitext]"])) != config_hash(cfg)
    assert config_hash(compose(TINY + ["eval.htp_exact=true"])) != config_hash(cfg)
    assert config_hash(compose(TINY + ["model.masked_softmax=false"])) != config_hash(cfg)
    assert config_hash(compose(TINY + ["quant=16a4w", "quant.weight_range=full"])) != \
        config_hash(compose(TINY + ["quant=16a4w"]))
    # weight_clip.objective likewise, in the run's hash and in the transform's own fingerprint (its cache key)
    from qexp.transforms import build_transforms

    clip = compose(TINY + ["quant=16a4w", "algorithm=[weight_clip]"])
    container = OmegaConf.to_container(clip, resolve=True, enum_to_str=True)
    for volatile in ("tracking", "cache_dir", "cache", "verbose", "device"):  # device: the CPU's leaves no trace
        container.pop(volatile, None)
    del container["eval"]["htp_exact"], container["quant"]["weight_range"], container["model"]["masked_softmax"]
    del container["model"]["tiny"]["config"]  # model.tiny.config came later too
    del container["sensitivity"], container["search"]  # None outside `python -m qexp.sensitivity` / `.search`
    for task_setting in ("tasks", "task_paths", "task_limit"):
        del container["eval"][task_setting]
    del container["algorithm"]["weight_clip"]["objective"]
    assert config_hash(clip) == stable_hash(container, length=16)
    assert build_transforms(clip.algorithm)[0].fingerprint()["config"] == {"n_grid": 100, "max_shrink": 0.8,
                                                                           "norm": 2.4}
    outputs = compose(TINY + ["quant=16a4w", "algorithm=[weight_clip]", "algorithm.weight_clip.objective=outputs"])
    assert config_hash(outputs) != config_hash(clip)
    assert build_transforms(outputs.algorithm)[0].fingerprint()["config"]["objective"] == "outputs"


def test_hint_points_to_htp_exact_only_for_a_real_gap():
    """An HTP run beyond its interval from the fake-quant program gets one line naming eval.htp_exact; within the
    interval, already htp_exact, or another backend: nothing."""
    from qexp.backends.registry import get_backend

    htp, xnnpack = get_backend("htp"), get_backend("xnnpack")
    gap = {"ppl_deployed_vs_qdq": 0.07, "ppl_deployed_vs_qdq_ci_low": 0.037, "ppl_deployed_vs_qdq_ci_high": 0.102}
    assert "eval.htp_exact=true" in htp.scoring_hint("fake_quant", gap) and "+7.00%" in htp.scoring_hint(
        "fake_quant", gap)
    below = {"ppl_deployed_vs_qdq": -0.03, "ppl_deployed_vs_qdq_ci_low": -0.05, "ppl_deployed_vs_qdq_ci_high": -0.01}
    assert htp.scoring_hint("fake_quant", below) is not None
    noise = {**gap, "ppl_deployed_vs_qdq_ci_low": -0.003}
    assert htp.scoring_hint("fake_quant", noise) is None
    assert htp.scoring_hint("htp_exact", gap) is None and xnnpack.scoring_hint("fake_quant", gap) is None
    assert htp.scoring_hint("fake_quant", {"ppl_deployed_vs_qdq": 0.07}) is None  # no interval: no claim
    assert htp.scoring_hint("fake_quant", {**gap, "ppl_deployed_vs_qdq_ci_low": float("nan")}) is None


def test_htp_arithmetic_sweep_composes(compose):
    """sweeps/htp_arithmetic.yaml: HTP on 8 windows, each scheme against both QDQ arithmetics."""
    from omegaconf import OmegaConf

    cfg = compose(["+sweep=htp_arithmetic", "model=gemma3_270m"], tracked=False)
    assert (cfg.model.name, cfg.backend.name, cfg.backend.eval_tokens) == ("gemma3_270m", "htp", 2048)
    assert cfg.tracking.sweep == "htp_arithmetic" and cfg.eval.htp_exact is False
    grid = OmegaConf.load(REPO / "sweeps" / "htp_arithmetic.yaml").hydra.sweeper.params
    assert grid["eval.htp_exact"] == "false,true" and grid["quant"] == "16a8w,16a4w"


def test_models_can_be_left_out_one_by_one(compose):
    """model_htp_arithmetic's `models` (diagnostics/diag_htp_exact_ops.py): each model applies alone, none is the
    fake-quant program bit for bit, and an unknown name is refused."""
    from qexp.quant.htp_arithmetic_pass import MODELS

    state = prepare(compose(TINY + ["quant=16a8w"]), "qdq")
    program, static = state.qdq.program.module, state.qdq.static
    ids = state.windows.ids[0].tolist()
    fake = window_logits(with_weights_dequantized(program), static, ids)
    nothing = with_weights_dequantized(program, "lpbq", htp_exact_models=())
    assert torch.equal(window_logits(nothing, static, ids), fake)
    from qexp.quant.htp_arithmetic_pass import CANDIDATE_MODELS

    counts = {m: with_weights_dequantized(program, "lpbq", htp_exact_models=(m,)).htp_counts
              for m in MODELS + CANDIDATE_MODELS}
    assert with_weights_dequantized(program, "lpbq").htp_counts.matmuls == 0  # a candidate: not in htp_exact
    assert counts["conv_accumulator_floor"].modelled > 0 and counts["conv_accumulator_floor"].norms == 0
    assert counts["matmul_accumulator_floor"].matmuls == 4 and counts["matmul_accumulator_floor"].modelled == 0
    assert counts["rms_norm_floor"].norms == 5 and counts["rms_norm_floor"].modelled == 0
    assert counts["softmax_exp15_floor"].softmaxes == 2 and counts["softmax_exp15_floor"].sigmoids == 0
    assert counts["sigmoid_15bit_floor"].sigmoids == 2 and counts["sigmoid_15bit_floor"].softmaxes == 0
    no_gelu = with_weights_dequantized(program, "lpbq", htp_exact_models=("gelu_phi_table",))  # llama has none
    assert torch.equal(window_logits(no_gelu, static, ids), fake)
    with pytest.raises(ValueError, match="unknown HTP arithmetic models"):
        with_weights_dequantized(program, "lpbq", htp_exact_models=("conv_floor",))
