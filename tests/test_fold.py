"""The QDQ evaluation runs a copy of the program whose weights are dequantized once and whose activations are
fake-quantized by one ATen op per quantize/dequantize pair, less the pairs that repeat a grid their input is already on
(qexp/quant/fold.py): its logits equal the program's bit for bit, for per-channel, per-block and 8-bit weights, and
the program keeps its integer weights."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY
from qexp.models.static_llama import window_logits
from qexp.pipeline import prepare
from qexp.quant.fold import fake_quantize, with_weights_dequantized


@pytest.mark.parametrize("quant", ["16a4w", "16a4w_block", "8a8w"])
def test_folded_program_is_bit_identical(quant, compose):
    state = prepare(compose(TINY + [f"quant={quant}"]), "qdq")
    program, static = state.qdq.program.module, state.qdq.static
    ops = lambda m: [str(n.target) for n in m.graph.nodes if n.op == "call_function"]  # noqa: E731
    folded = with_weights_dequantized(program)
    every_pair = with_weights_dequantized(program, drop_redundant=False)
    assert len(ops(folded)) < len(ops(program))  # the weights' dequantize ops are gone from the copy ...
    # ... and the activations' quantize/dequantize pairs are one fake_quantize each ...
    assert not any(op.startswith("quantized_decomposed.") and "per_tensor" in op for op in ops(folded))
    pairs = [n for n in program.graph.nodes if str(n.target) == "quantized_decomposed.dequantize_per_tensor.default"
             and str(n.args[0].target) == "quantized_decomposed.quantize_per_tensor.default"]
    fakes = lambda m: sum(n.target is fake_quantize for n in m.graph.nodes)  # noqa: E731
    assert pairs and fakes(every_pair) == len(pairs)
    # ... of which those that repeat their input's grid (a view quantized again, one pair per consumer) are dropped
    assert fakes(folded) < 0.6 * len(pairs)
    for ids in state.windows.ids[:2].tolist():
        reference = window_logits(program, static, ids)
        assert torch.equal(window_logits(folded, static, ids), reference)
        assert torch.equal(window_logits(every_pair, static, ids), reference)
    integer = [n for n in program.graph.nodes if n.op == "get_attr"
               and getattr(program, n.target).dtype in (torch.int8, torch.uint8, torch.int16, torch.int32)]
    assert integer  # the program itself still holds its integer weights


def test_fused_fake_quant_equals_the_quantize_dequantize_pair_at_every_rounding_tie():
    """qexp's one-buffer fake_quantize against quantized_decomposed's two ops, on random scales and zero points, with
    inputs on exact rounding ties (x = (k + 0.5) s), far outside the range, and at the range's ends."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed

    qd = torch.ops.quantized_decomposed
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        scale = float(torch.tensor(float(torch.rand(1, generator=g)) * 10 ** (trial % 7 - 5), dtype=torch.float32))
        lo, hi, dtype = [(0, 65535, torch.uint16), (0, 255, torch.uint8), (-32767, 32767, torch.int16)][trial % 3]
        zp = 0 if lo < 0 else int(torch.randint(lo, hi + 1, (1,), generator=g))
        x = torch.randn(2048, generator=g) * scale * hi / 3
        x[:512] = (torch.randint(-hi, hi, (512,), generator=g).float() + 0.5) * scale
        x[512:520] = torch.tensor([1e30, -1e30, (hi - zp) * scale, (lo - zp) * scale, 0.0, -0.0, 3e-39, -3e-39])
        pair = qd.dequantize_per_tensor(qd.quantize_per_tensor(x, scale, zp, lo, hi, dtype), scale, zp, lo, hi, dtype)
        assert torch.equal(fake_quantize(x, scale, zp, lo, hi), pair), (scale, zp)
