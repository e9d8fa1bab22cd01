"""The QDQ evaluation runs a copy of the program whose weights are dequantized once (qexp/quant/fold.py): its
logits equal the program's bit for bit, for per-channel, per-block and 8-bit weights, and the program keeps its
integer weights."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY
from qexp.models.static_llama import window_logits
from qexp.pipeline import prepare
from qexp.quant.fold import with_weights_dequantized


@pytest.mark.parametrize("quant", ["16a4w", "16a4w_block", "8a8w"])
def test_folded_program_is_bit_identical(quant, compose):
    state = prepare(compose(TINY + [f"quant={quant}"]), "qdq")
    program, static = state.qdq.program.module, state.qdq.static
    ops = lambda m: [str(n.target) for n in m.graph.nodes if n.op == "call_function"]  # noqa: E731
    folded = with_weights_dequantized(program)
    assert len(ops(folded)) < len(ops(program))  # the weights' dequantize ops are gone from the copy ...
    assert any("dequantize_per_tensor" in op for op in ops(folded))  # ... the activations' stay
    for ids in state.windows.ids[:2].tolist():
        assert torch.equal(window_logits(folded, static, ids), window_logits(program, static, ids))
    integer = [n for n in program.graph.nodes if n.op == "get_attr"
               and getattr(program, n.target).dtype in (torch.int8, torch.uint8, torch.int16, torch.int32)]
    assert integer  # the program itself still holds its integer weights
