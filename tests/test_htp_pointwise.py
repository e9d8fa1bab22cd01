"""eval.htp_exact's pointwise ops, and the candidate matmul model (qexp/quant/htp_arithmetic.py): HTP's 16-bit
softmax keeps exp as a 15-bit integer and floors its output; its 16-bit sigmoid keeps 15 bits, floored; its 16-bit
GELU is x * phi(x) with its own phi, measured on the emulator into qexp/quant/htp_gelu_phi.csv; its 16x16-bit matmul
keeps its accumulator to 2**16 units. The definitions, the table, the program pass, and the ops on the x86 HTP
emulator (the GELU over every input code of a range the table was not measured on;
diagnostics/diag_htp_pointwise.py prints the same on more inputs)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from helpers import REPO, TINY
from qexp.pipeline import prepare
from qexp.quant.fold import with_weights_dequantized
from qexp.quant.htp_arithmetic import gelu_phi_table, htp_gelu, htp_softmax, quantize_sigmoid_fifteen_bits

sys.path.insert(0, str(REPO))


def test_sigmoid_quantize_is_fifteen_bits_floored():
    y = torch.sigmoid(torch.linspace(-20, 20, 100_001))
    codes = quantize_sigmoid_fifteen_bits(y, 1 / 65536, 0, 0, 65535, torch.int32).long()
    assert bool((codes % 2 == 0).all())
    assert torch.equal(codes, (2 * torch.floor(y.double() * 32768)).clamp(max=65534).long())
    assert codes.max() == 65534 and codes.min() == 0  # sigmoid(20) is 1.0 in float32: HTP's top code is even too


def test_softmax_keeps_exp_as_a_15bit_integer():
    """htp_softmax (float32) is its definition in float64: E = floor(2**15 exp(x - max)), E / sum(E); a masked key
    (-255) gets exactly 0, and the row sums to 1 within float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 4, 16, 512, generator=generator) * 3
    scores[..., 300:] = -255.0
    fixed = torch.floor(torch.exp(scores.double() - scores.double().amax(-1, keepdim=True)) * 32768)
    expected = fixed / fixed.sum(-1, keepdim=True)
    got = htp_softmax(scores, -1)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), expected, rtol=1e-6, atol=0)
    assert bool((got[..., 300:] == 0).all()) and torch.allclose(got.sum(-1), torch.ones(2, 4, 16), atol=1e-5)
    assert not torch.allclose(got, torch.softmax(scores, -1), rtol=1e-6, atol=0)


def test_gelu_phi_table_is_near_the_normal_cdf():
    """The measured phi is the normal CDF within a few 1/4096 (its ripple and its tails), on a uniform grid; nearest
    0, where phi = y / x is least resolved, within 6."""
    start, step, phi = gelu_phi_table()
    x = start + step * torch.arange(phi.numel(), dtype=torch.float64)
    cdf = 4096 * 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    assert start == -8 and step == 1 / 128 and phi.numel() == 2049
    assert (phi - cdf)[x.abs() >= 0.25].abs().max() < 3.5 and (phi - cdf).abs().max() < 8
    assert 0.5 < phi[0] < 1.5 and 4094.5 < phi[-1] < 4095.5  # the tails: 1/4096 off the CDF, not 0 and 1


def test_htp_gelu_interpolates_the_table_and_holds_its_ends():
    start, step, phi = gelu_phi_table()
    grid = torch.tensor([start + 3 * step, 0.5, 2.0], dtype=torch.float64)
    at = [3, round((0.5 - start) / step), round((2.0 - start) / step)]
    assert torch.allclose(htp_gelu(grid), grid * phi[at] / 4096, rtol=1e-12, atol=0)
    middle = torch.tensor([0.5 + step / 4], dtype=torch.float64)
    i = round((0.5 - start) / step)
    assert torch.allclose(htp_gelu(middle), middle * (0.75 * phi[i] + 0.25 * phi[i + 1]) / 4096, rtol=1e-12)
    far = torch.tensor([-30.0, 25.0], dtype=torch.float64)
    assert torch.allclose(htp_gelu(far), far * phi[[0, -1]] / 4096, rtol=1e-12)
    assert htp_gelu(torch.ones(3)).dtype == torch.float32


@pytest.mark.parametrize("model, op", [("tiny", "sigmoid"), ("tiny_gemma3", "gelu")])
def test_program_pass_models_16bit_pointwise_ops(model, op, compose):
    """Every 16-bit softmax, sigmoid and GELU of the program is modelled; at 8 bits none is (not measured)."""
    for quant, modelled in [("16a4w", True), ("8a8w", False)]:
        state = prepare(compose(TINY + [f"model={model}", f"quant={quant}"]), "qdq")
        program = state.qdq.program.module

        def count(name):
            return sum(1 for n in program.graph.nodes if n.op == "call_function" and f"aten.{name}" in str(n.target))

        ops, softmaxes = count(op), count("softmax")
        counts = with_weights_dequantized(program, "lpbq").htp_counts
        got = counts.sigmoids if op == "sigmoid" else counts.gelus
        assert ops > 0 and softmaxes == 2 and got == (ops if modelled else 0), (quant, ops, counts)  # 2 layers
        assert counts.softmaxes == (softmaxes if modelled else 0)
        assert counts.pointwise_kept == (0 if modelled else ops + softmaxes)
        assert counts.matmuls == 0  # a candidate model only (htp_arithmetic's docstring)


def _on_emulator(op, lo, hi):
    from diagnostics.diag_htp_pointwise import agreement, all_codes_on_htp, softmax_rows_on_htp
    from qexp import upstream

    soc = upstream.QcomChipset.SM8650
    probe = softmax_rows_on_htp(lo, hi, soc) if op == "softmax" else all_codes_on_htp(op, lo, hi, soc)
    assert probe["modelled"] == 1
    return probe, agreement(probe["htp"], probe["htp_exact"]), agreement(probe["htp"], probe["fake_quant"])


def test_htp_sigmoid_is_fifteen_bits_floored_on_the_emulator(cache_dir):
    """Measured over [-6, 6]: HTP's codes are all even, 79% identical to htp_exact's with no bias, against 25% and a
    one-code bias for the fake-quant program."""
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.cache import Cache

    ensure_qnn_sdk(Cache(cache_dir))
    probe, exact, fake = _on_emulator("sigmoid", -6.0, 6.0)
    assert bool((probe["htp"] % 2 == 0).all())
    assert exact["identical"] > 0.7 and abs(exact["mean"]) < 0.05 and exact["rms"] < 1.0
    assert fake["mean"] < -0.5 and fake["identical"] < 0.5


def test_htp_gelu_follows_the_measured_phi_on_the_emulator(cache_dir):
    """Over [-12, 12] (not a range the table was measured on): htp_exact 1.1 codes rms from HTP, the tanh-GELU
    fake-quant program 8.6 with a -6 code bias (its tails)."""
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.cache import Cache

    ensure_qnn_sdk(Cache(cache_dir))
    _, exact, fake = _on_emulator("gelu", -12.0, 12.0)
    assert exact["rms"] < 0.3 * fake["rms"] and abs(exact["mean"]) < 1 and fake["mean"] < -3


def test_htp_matmul_keeps_its_accumulator_to_2_16_on_the_emulator(cache_dir):
    """A 16x16-bit matmul with its second operand quantized to int16 directly: 99% of HTP's codes are the candidate
    matmul model's (the program's exact product: ~50%, half a code above). Not in eval.htp_exact: in the attention
    that operand is converted from uint16 first, which the model does not cover (diagnostics/diag_htp_pointwise.py)."""
    from diagnostics.diag_htp_pointwise import agreement, matmul_on_htp
    from qexp import upstream
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.cache import Cache

    ensure_qnn_sdk(Cache(cache_dir))
    direct = matmul_on_htp(False, upstream.QcomChipset.SM8650)
    assert direct["modelled"] == 1
    model, fake = agreement(direct["htp"], direct["matmul_model"]), agreement(direct["htp"], direct["fake_quant"])
    assert model["identical"] > 0.98 and fake["identical"] < 0.9 and fake["mean"] < -0.1


def test_htp_softmax_is_a_15bit_exp_floored_on_the_emulator(cache_dir):
    """Rows of 128 keys (scores std 2, causal mask): 96% of HTP's codes are htp_exact's (0.24 code rms, no bias),
    against 68%, 1.15 rms and a -0.24 code bias for the fake-quant program (its probabilities sum above HTP's)."""
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.cache import Cache

    ensure_qnn_sdk(Cache(cache_dir))
    _, exact, fake = _on_emulator("softmax", 128, 2.0)
    assert exact["identical"] > 0.9 and abs(exact["mean"]) < 0.05 and exact["rms"] < 0.5
    assert fake["mean"] < -0.15 and fake["identical"] < exact["identical"] - 0.2 and fake["rms"] > 2 * exact["rms"]
