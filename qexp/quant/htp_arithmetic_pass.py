"""The pass that gives a QDQ program HTP's arithmetic (eval.htp_exact): it rewrites, in place, the 16-bit-activation
convolutions, linears, RMSNorms, softmaxes, sigmoids and GELUs (and, for the diagnostics, the candidate matmul model)
of a converted program's FX graph with the integer kernels of qexp.quant.htp_arithmetic, whose module docstring says
what HTP computes and how it was measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qexp.quant.fx_constants import constant_value
from qexp.quant.htp_arithmetic import (
    htp_conv1x1,
    htp_gelu,
    htp_integer_weights,
    htp_linear,
    htp_matmul,
    htp_softmax,
    quantize_per_tensor_floor,
    quantize_sigmoid_fifteen_bits,
)

# what the pass models, tagged on runs (htp_exact_model); a sweep does not resume from a run with another one
MODELLED_OPS = "conv_accumulator_floor,rms_norm_floor,softmax_exp15_floor,sigmoid_15bit_floor,gelu_phi_table"
MODELS = tuple(MODELLED_OPS.split(","))  # each can be left out (model_htp_arithmetic's `models`) to measure it
# measured on the emulator but not where these programs use it, so not part of eval.htp_exact
# (qexp.quant.htp_arithmetic's docstring); the diagnostics can add it
CANDIDATE_MODELS = ("matmul_accumulator_floor",)


@dataclass
class ModelledCounts:
    modelled: int = 0  # layers now computed with HTP's integer arithmetic
    kept: int = 0  # convolutions / linears left in float (8-bit activations, 16-bit weights, unknown encodings)
    matmuls: int = 0  # uint16 x int16 activation matmuls now computed with HTP's accumulator
    matmuls_kept: int = 0  # matmuls of other encodings, left as the program computes them
    norms: int = 0  # 16-bit RMSNorm outputs now requantized with a floor
    norms_kept: int = 0  # RMSNorms left rounding to nearest (8-bit input or output)
    softmaxes: int = 0  # 16-bit softmaxes now computed with HTP's 15-bit exp, their output floored
    sigmoids: int = 0  # 16-bit sigmoid outputs now floored to 15 bits
    gelus: int = 0  # 16-bit GELUs now computed with HTP's phi
    pointwise_kept: int = 0  # softmaxes / sigmoids / GELUs left as the program computes them (8-bit input or output)

    def describe(self) -> str:
        return (f"{self.modelled} layers with HTP's integer arithmetic, {self.kept} left as fake-quant; "
                f"{self.matmuls} matmuls with HTP's accumulator, {self.matmuls_kept} left; "
                f"{self.norms} RMSNorm outputs floored, {self.norms_kept} left; {self.softmaxes} softmaxes with a "
                f"15-bit exp, {self.sigmoids} sigmoids at 15 bits, {self.gelus} GELUs with HTP's phi, "
                f"{self.pointwise_kept} left")


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


def _sixteen_bit_symmetric_input(node):
    """(x_q node, scale) when `node` dequantizes an int16 symmetric activation, else None."""
    if not _is(node, "dequantize_per_tensor"):
        return None
    q, scale, zp, qmin, qmax = node.args[:5]
    if not isinstance(q, torch.fx.Node) or q.op == "get_attr" or (qmin, qmax) != (-32767, 32767) or zp != 0:
        return None
    return (q, float(scale)) if isinstance(scale, (float, int)) else None


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


def _erase_unused(graph, nodes) -> None:
    """The dequantize ops only a replaced layer read, and the weight's constants behind them."""
    for dead in nodes:
        if isinstance(dead, torch.fx.Node) and not dead.users:
            sources = [a for a in dead.all_input_nodes if a.op == "get_attr"]
            graph.erase_node(dead)
            for source in sources:
                if not source.users:
                    graph.erase_node(source)


def model_htp_arithmetic(module: torch.fx.GraphModule, w4_lowering: str = "lpbq",
                         models: tuple = MODELS) -> ModelledCounts:
    """Replace, in place, every 1x1 convolution / linear with a uint16 input and <= 8-bit symmetric weights by HTP's
    integer arithmetic, floor every 16-bit RMSNorm's output quantization, and give 16-bit softmaxes, sigmoids and
    GELUs HTP's arithmetic (qexp.quant.htp_arithmetic's docstring). Run it before fold_weight_dequantize: it reads
    the integer weights.
    `models`: which of MODELS (and CANDIDATE_MODELS: uint16 x int16 activation matmuls) to apply; qexp runs apply
    MODELS, diagnostics/diag_htp_exact_ops.py leaves each out in turn and adds the candidates."""
    unknown = set(models) - set(MODELS) - set(CANDIDATE_MODELS)
    if unknown:
        raise ValueError(f"unknown HTP arithmetic models {sorted(unknown)}; known: "
                         f"{', '.join(MODELS + CANDIDATE_MODELS)}")
    counts = ModelledCounts()
    graph = module.graph
    for node in list(graph.nodes) if "conv_accumulator_floor" in models else []:
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
        _erase_unused(graph, (x_arg, w_arg))
        counts.modelled += 1
    if "matmul_accumulator_floor" in models:
        _model_matmuls(module, counts)
    if "rms_norm_floor" in models:
        _floor_norm_outputs(graph, counts)
    _model_pointwise(graph, counts, models)
    graph.lint()
    module.recompile()
    return counts


def _model_matmuls(module: torch.fx.GraphModule, counts: ModelledCounts) -> None:
    """Replace, in place, every matmul of a uint16 activation by an int16 symmetric one with htp_matmul."""
    graph = module.graph
    for node in list(graph.nodes):
        if not (_is(node, "aten.matmul") or _is(node, "aten.bmm")):
            continue
        a_arg, b_arg = node.args[:2]
        a, b = _sixteen_bit_input(a_arg), _sixteen_bit_symmetric_input(b_arg)
        if a is None or b is None:
            counts.matmuls_kept += 1
            continue
        (a_q, a_scale, a_zp), (b_q, b_scale) = a, b
        with graph.inserting_before(node):
            replacement = graph.call_function(htp_matmul, (a_q, a_scale, a_zp, b_q, b_scale))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        for dead in (a_arg, b_arg):
            if isinstance(dead, torch.fx.Node) and not dead.users:
                graph.erase_node(dead)
        counts.matmuls += 1


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


def _sixteen_bit_output_quantizes(node) -> list | None:
    """The quantize ops reading `node` when every one of them is uint16, else None."""
    quantizes = [user for user in node.users if _is(user, "quantize_per_tensor") and not _is(user, "dequantize")]
    if not quantizes or any(tuple(q.args[3:5]) != (0, 65535) for q in quantizes):
        return None
    return quantizes


def _model_pointwise(graph: torch.fx.Graph, counts: ModelledCounts, models: tuple) -> None:
    """16-bit softmaxes: HTP's 15-bit exp, their output quantize floored; 16-bit sigmoids: at 15 bits, floored;
    16-bit GELUs: computed with HTP's phi."""
    for node in graph.nodes:
        softmax, sigmoid, gelu = _is(node, "aten._softmax") or _is(node, "aten.softmax"), _is(node, "aten.sigmoid"), \
            _is(node, "aten.gelu")
        if not (softmax and "softmax_exp15_floor" in models or sigmoid and "sigmoid_15bit_floor" in models
                or gelu and "gelu_phi_table" in models):
            continue
        quantizes = _sixteen_bit_output_quantizes(node)
        if _sixteen_bit_input(node.args[0]) is None or quantizes is None:
            counts.pointwise_kept += 1
            continue
        if softmax:
            node.target = htp_softmax
            for quantize in quantizes:
                quantize.target = quantize_per_tensor_floor
            counts.softmaxes += 1
        elif sigmoid:
            if any((q.args[1], q.args[2]) != (1 / 65536, 0) for q in quantizes):  # QNN's fixed sigmoid encoding
                counts.pointwise_kept += 1
                continue
            for quantize in quantizes:
                quantize.target = quantize_sigmoid_fifteen_bits
            counts.sigmoids += 1
        else:
            node.target = htp_gelu
            counts.gelus += 1
