"""HTP's integer arithmetic for 16-bit-activation convolutions and linears, modelled in the QDQ program (eval.htp_exact).

The QDQ (fake-quant) program computes each layer in float: y = conv(s_x (x_q - zp), s_w w_q). HTP computes it in
integers, and with 16-bit activations it does not keep the whole accumulator. Measured on single layers through the
x86 HTP emulator (benchmarks/diag_htp_weight_bits.py, #18), HTP's FullyConnected / Conv2d with uint16 activations:
  1. T = sum_c w[o, c] * (x_q[c] - 32768), exact (activations re-centred on 32768, whatever their zero point);
  2. drops T's low 8 bits with a floor: T' = floor(T / 256) * 256 (no rounding: a per-channel negative offset);
  3. adds the zero-point correction Z = (32768 - zp) * sum_c w[o, c], rounded to the same 256-unit grid;
  4. requantizes s_x * unit[o] * (T' + Z') to the output's 16-bit grid.
The weights w and their unit are what the kernel receives, which depends on the encoding:
  - per-channel 8-bit, or 4-bit lowered per channel (backend.w4_lowering=per_channel): w_q at scale s;
  - per-channel 4-bit lowered as LPBQ with one block per row (backend.w4_lowering=lpbq, convolutions only):
    16 * w_q at s / 16 (the 16x finer accumulator is why that lowering fixes the 16a4w gap);
  - LPBQ blocks: unit = max_b(s_b) / 16 and w = w_q * clamp(round(s_b / unit), 1, 16), as ExecuTorch's
    `make_qnn_per_block_config` encodes them (qexp.quant.lpbq); with block_scale_rounding=float the block scales HTP
    runs differ from the program's, and this models the ones HTP runs.
Step 1 is computed in float64, where every partial sum is an integer below 2**53 (|w| <= 128, |x_q - 32768| <= 32768,
a few thousand input channels), so it is exact. Layers with 8-bit activations or 16-bit weights keep the QDQ
arithmetic (no measured model of their kernels); the pass returns how many layers it modelled and left.

HTP's RMSNorm with a uint16 input and output requantizes its result with a floor, not to nearest: on one norm alone
on the emulator (640 channels, gains 1 + |N(0, 0.1)| and 1 + 50 |N(0, 1)|), 99.9% of its outputs are floor(y / s) of
the QDQ program's pre-quantization value y, against 50% for round(y / s), every other one a step lower
(benchmarks/diag_htp_ops.py measures each op's departure on HTP's own inputs in a whole model: its rms_norm rows show
a -0.5 step mean). Those norms get a quantize with a floor. 8-bit norms are not floored (54% round, 72% floor on a
one-off 8a8w probe: no simple model) and are left.

Whether a phone's HTP truncates the same way as the emulator cannot be checked on this machine (README, "HTP's
arithmetic"): the android target's perplexity against an `htp_exact` run is that check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qexp.quant.fold import constant_value

log = logging.getLogger("qexp")

CENTRE = 32768  # HTP re-centres uint16 activations on 2**15
DROPPED = 256  # the accumulator's low 8 bits, dropped with a floor
SCALE_STEPS = 16  # LPBQ block scales are 4-bit multiples of max_b(s_b) / 16


MODELLED_OPS = "conv_accumulator_floor,rms_norm_floor"  # what the pass models: tagged on runs (htp_exact_model)


@dataclass
class ModelledCounts:
    modelled: int = 0  # layers now computed with HTP's integer arithmetic
    kept: int = 0  # convolutions / linears left in float (8-bit activations, 16-bit weights, unknown encodings)
    norms: int = 0  # 16-bit RMSNorm outputs now requantized with a floor
    norms_kept: int = 0  # RMSNorms left rounding to nearest (8-bit input or output)

    def describe(self) -> str:
        return (f"{self.modelled} layers with HTP's integer arithmetic, {self.kept} left as fake-quant; "
                f"{self.norms} RMSNorm outputs floored, {self.norms_kept} left")


def quantize_per_tensor_floor(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
                              dtype: torch.dtype) -> torch.Tensor:
    """quantize_per_tensor with a floor where it rounds to nearest (the same float32 arithmetic otherwise): how HTP
    requantizes a 16-bit RMSNorm's output (module docstring)."""
    return torch.clamp(torch.floor(x * (1.0 / scale)) + zero_point, quant_min, quant_max).to(dtype)


def htp_integer_weights(w_q: torch.Tensor, scale: torch.Tensor, kind: str, lpbq_per_channel: bool):
    """(w, unit): the integers HTP's kernel multiplies (float64, same shape as w_q) and each output channel's scale.

    kind: "per_channel" (scale [out]) or "block" (scale [out, n_blocks], blocks along the input channels)."""
    w_q = w_q.to(torch.float64)
    scale = scale.to(torch.float64)
    if kind == "per_channel":
        if lpbq_per_channel:  # one block per row: the block scale s is 16 steps of s / 16
            return w_q * SCALE_STEPS, scale / SCALE_STEPS
        return w_q, scale
    flat = scale.reshape(scale.shape[0], -1)
    unit = flat.amax(dim=1) / SCALE_STEPS
    steps = torch.clamp(torch.round(flat / unit[:, None]), 1, SCALE_STEPS)
    block = w_q.shape[1] // flat.shape[1]
    expanded = steps.repeat_interleave(block, dim=1).reshape(steps.shape[0], w_q.shape[1], *([1] * (w_q.dim() - 2)))
    return w_q * expanded, unit


def htp_accumulate(x_q: torch.Tensor, x_zp: int, w: torch.Tensor) -> torch.Tensor:
    """HTP's integer result T' + Z' for x_q [..., C] (uint16 values) and w [O, C]: [..., O], float64 integers."""
    centred = x_q.to(torch.float64) - CENTRE
    acc = centred @ w.T  # exact: integer partial sums < 2**53
    truncated = torch.floor(acc / DROPPED) * DROPPED
    correction = torch.round((CENTRE - x_zp) * w.sum(dim=1) / DROPPED) * DROPPED
    return truncated + correction


def htp_conv1x1(x_q: torch.Tensor, x_scale: float, x_zp: int, w: torch.Tensor, unit: torch.Tensor, bias=None):
    """A 1x1 convolution (NCHW) with 16-bit activations as HTP computes it; float32 output (pre-requantization)."""
    acc = htp_accumulate(x_q.permute(0, 2, 3, 1), x_zp, w.reshape(w.shape[0], -1))
    y = (acc * (x_scale * unit)).permute(0, 3, 1, 2)
    if bias is not None:  # not measured on HTP (no bias in the llama layouts qexp lowers today): added in float
        y = y + bias.to(torch.float64)[None, :, None, None]
    return y.to(torch.float32)


def htp_linear(x_q: torch.Tensor, x_scale: float, x_zp: int, w: torch.Tensor, unit: torch.Tensor, bias=None):
    """A linear layer with 16-bit activations as HTP's FullyConnected computes it; float32 output."""
    y = htp_accumulate(x_q, x_zp, w) * (x_scale * unit)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)


def _is(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and name in str(node.target)


def _sixteen_bit_input(node):
    """(x_q node, scale, zero point) when `node` dequantizes a uint16 activation, else None."""
    if not _is(node, "dequantize_per_tensor"):
        return None
    q, scale, zp, qmin, qmax = node.args[:5]
    if not isinstance(q, torch.fx.Node) or q.op == "get_attr" or (qmin, qmax) != (0, 65535):
        return None
    if not isinstance(scale, (float, int)) or not isinstance(zp, int):
        return None
    return q, float(scale), zp


def _weight(module, node):
    """(w_q, scale, kind) for a weight dequantized from symmetric constants with at most 8 bits, else None."""
    try:
        if _is(node, "dequantize_per_channel"):
            w_q, scale, zp, axis, qmin, qmax = (constant_value(module, a) for a in node.args[:6])
            if axis != 0:
                return None
            kind = "per_channel"
        elif _is(node, "dequantize_affine"):
            w_q, block_size, scale, zp = (constant_value(module, a) for a in node.args[:4])
            qmin, qmax = node.args[5:7] if len(node.args) >= 7 else (node.kwargs["quant_min"], node.kwargs["quant_max"])
            if block_size[0] != 1 or any(b != 1 for b in block_size[2:]):
                return None
            kind = "block"
        elif _is(node, "dequantize_per_tensor"):
            w_q, scale, zp, qmin, qmax = (constant_value(module, a) for a in node.args[:5])
            scale = torch.full((w_q.shape[0],), float(scale))
            zp = torch.zeros(w_q.shape[0]) + zp
            kind = "per_channel"
        else:
            return None
    except ValueError:
        return None  # not constant
    if not isinstance(w_q, torch.Tensor) or qmax - qmin > 255 or bool((torch.as_tensor(zp) != 0).any()):
        return None
    return w_q, torch.as_tensor(scale), kind, qmax - qmin <= 15


def model_htp_arithmetic(module: torch.fx.GraphModule, w4_lowering: str = "lpbq") -> ModelledCounts:
    """Replace, in place, every 1x1 convolution / linear with a uint16 input and <= 8-bit symmetric weights by HTP's
    integer arithmetic, and floor every 16-bit RMSNorm's output quantization (module docstring). Run it before
    fold_weight_dequantize: it reads the integer weights."""
    counts = ModelledCounts()
    graph = module.graph
    for node in list(graph.nodes):
        conv, linear = _is(node, "aten.conv2d"), _is(node, "aten.linear")
        if not (conv or linear):
            continue
        x_arg, w_arg = node.args[0], node.args[1]
        bias_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if conv:
            rest = list(node.args[3:])  # stride, padding, dilation, groups
            plain = all(v in (1, [1], [1, 1], 0, [0], [0, 0]) for v in rest)
            if not plain:
                counts.kept += 1
                continue
        activation, weight = _sixteen_bit_input(x_arg), _weight(module, w_arg)
        if activation is None or weight is None:
            counts.kept += 1
            continue
        w_q, scale, kind, four_bit = weight
        if conv and tuple(w_q.shape[2:]) != (1, 1):
            counts.kept += 1
            continue
        lpbq_per_channel = kind == "per_channel" and four_bit and conv and w4_lowering == "lpbq"
        w, unit = htp_integer_weights(w_q, scale.reshape(-1) if kind == "per_channel" else scale, kind,
                                      lpbq_per_channel)
        index = counts.modelled
        module.register_buffer(f"_qexp_htp_w_{index}", w.reshape(w.shape[0], -1).contiguous())
        module.register_buffer(f"_qexp_htp_unit_{index}", unit.reshape(-1).contiguous())
        q, x_scale, x_zp = activation
        with graph.inserting_before(node):
            w_node = graph.get_attr(f"_qexp_htp_w_{index}")
            unit_node = graph.get_attr(f"_qexp_htp_unit_{index}")
            replacement = graph.call_function(htp_conv1x1 if conv else htp_linear,
                                              (q, x_scale, x_zp, w_node, unit_node, bias_arg))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        for dead in (x_arg, w_arg):  # the dequantize ops only this layer read, and the weight's constants
            if isinstance(dead, torch.fx.Node) and not dead.users:
                sources = [a for a in dead.all_input_nodes if a.op == "get_attr"]
                graph.erase_node(dead)
                for source in sources:
                    if not source.users:
                        graph.erase_node(source)
        counts.modelled += 1
    _floor_norm_outputs(graph, counts)
    graph.lint()
    module.recompile()
    return counts


def _floor_norm_outputs(graph: torch.fx.Graph, counts: ModelledCounts) -> None:
    """Retarget, in place, the quantize of every RMSNorm output with a uint16 input and output to a floor."""
    for node in graph.nodes:
        if not _is(node, "aten.rms_norm"):
            continue
        quantizes = [user for user in node.users if _is(user, "quantize_per_tensor") and
                     not _is(user, "dequantize")]
        sixteen_bit = [q for q in quantizes if tuple(q.args[3:5]) == (0, 65535)]
        if _sixteen_bit_input(node.args[0]) is None or not sixteen_bit or len(sixteen_bit) != len(quantizes):
            counts.norms_kept += 1
            continue
        for quantize in sixteen_bit:
            quantize.target = quantize_per_tensor_floor
        counts.norms += 1
