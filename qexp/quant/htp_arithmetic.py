"""HTP's arithmetic for 16-bit-activation convolutions, linears, RMSNorms, softmaxes, sigmoids and GELUs, modelled in
the QDQ program (eval.htp_exact); a candidate model of its matmul for the diagnostics.

The QDQ (fake-quant) program computes each layer in float: y = conv(s_x (x_q - zp), s_w w_q). HTP computes it in
integers, and with 16-bit activations it does not keep the whole accumulator. Measured on single layers through the
x86 HTP emulator (diagnostics/diag_htp_weight_bits.py), HTP's FullyConnected / Conv2d with uint16 activations:
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

HTP's MatMul of two activations, a uint16 A (zero point za) and an int16 symmetric B, keeps its accumulator to 2**16
units: T = floor(sum_k a_q b_q / 2**16) * 2**16, minus the zero-point correction za * sum_k b_q rounded to the same
grid, requantized to nearest: 99.0-99.6% of its codes on the emulator, against 50-82% for the program's exact
product, which sits 0.16-0.48 code above HTP depending on the encodings (one-op probes: Gaussian operands with A's
zero point 28487 and 1389, probabilities times values; diagnostics/diag_htp_pointwise.py; computed in float64,
exact: |a_q b_q| < 2**31, a few hundred keys). But in these programs B (the attention's K and V) reaches the matmul
through a uint16 tensor that HTP converts to int16 first, and its conversion is not reproduced: it rounds to
nearest for ~95% of values and is one code off for the rest (read back through an identity matmul, one-off probe; no
fixed-point multiplier of 8-31 bits fits), which leaves the model 61-67% identical there, the bias moved from -0.45
to -0.02 code on one operand pair and from -0.22 to +0.21 on another. So the matmul model (htp_matmul,
"matmul_accumulator_floor") is a candidate the diagnostics can add, not part of eval.htp_exact.

HTP's RMSNorm with a uint16 input and output requantizes its result with a floor, not to nearest: on one norm alone
on the emulator (640 channels, gains 1 + |N(0, 0.1)| and 1 + 50 |N(0, 1)|), 99.9% of its outputs are floor(y / s) of
the QDQ program's pre-quantization value y, against 50% for round(y / s), every other one a step lower
(diagnostics/diag_htp_ops.py measures each op's departure on HTP's own inputs in a whole model: its rms_norm rows show
a -0.5 step mean). Those norms get a quantize with a floor. 8-bit norms are not floored (54% round, 72% floor on a
one-off 8a8w probe: no simple model) and are left.

HTP's 16-bit Softmax keeps exp(x - max) as a 15-bit fixed-point integer, E = floor(2**15 exp(x - max)), divides
it by the row's sum of them, and requantizes the quotient with a floor: on rows of Gaussian scores (std 1-3) with a
causal mask, 64-256 keys, 93-99% of its codes are floor(E / sum(E) / s), 0.11-0.27 code rms from it, against 68-80%
and 0.5-2.0 rms for the program's round(softmax(x) / s), which also sits 0.2 code above HTP on average (every row of
its probabilities sums above HTP's) and 2-3 codes rms off HTP's large probabilities, where the 15-bit exp's error
is largest relative to the output step (diagnostics/diag_htp_pointwise.py). An attention output is a sum of values
weighted by those probabilities, so that is where it shows. Those softmaxes are computed that way (htp_softmax).

HTP's 16-bit Sigmoid keeps 15 bits, floored: over all 65,536 input codes on the emulator every output code is even
and 85-92% of them are 2 * floor(sigmoid(x) * 32768) (the rest are 2 codes either side, evenly: its sigmoid is an
approximation within one 15-bit step), against 30-52% for the fake-quant program's round(sigmoid(x) * 65536), which
sits 0.6-0.9 code above HTP on average (diagnostics/diag_htp_pointwise.py). SiLU is a sigmoid and a mul in these
programs, so every SmolLM2 / Llama / Qwen MLP has one. Those sigmoids get that quantize.

HTP's 16-bit GELU is neither the tanh form the program computes nor the erf form: it is x * phi(x) with its own phi,
within ~3/4096 of the normal CDF and rippling about it in [-4, 4] (a polynomial's error; within 6 nearest 0, where
the table resolves phi least), and 1/4096 off it beyond (about 1/4096 below -5.3 and 1 - 1/4096 above 4.6: a large
negative input gives a small negative output, a large positive one x (1 - 1/4096)). QNN ignores `approximate`
(executorch/backends/qualcomm/builders/op_gelu.py). qexp models it with phi measured on the emulator
(htp_gelu_phi.csv, written by diagnostics/diag_htp_pointwise.py: a function of x on a 1/128 grid in [-8, 8], held at
its ends beyond). On input ranges the table was not measured on, HTP's codes are then 0.9-2.4 codes rms from the
model, with a bias of at most 0.5 code, against 6.5-12.1 rms and biases up to -10 codes (the tails) from the
fake-quant program; 29-43% are identical (which codes HTP gets depends on fixed-point details of its kernel that a
function of x does not carry). Eight-bit sigmoids and GELUs keep the program's arithmetic (not measured).
HTP's sigmoid and GELU gave identical outputs with the emulator set to SM8450, SM8650 and SM8750 (a one-off probe).

Whether a phone's HTP truncates the same way as the emulator cannot be checked on this machine
(docs/htp-arithmetic.md): the android target's perplexity against an `htp_exact` run is that check.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from qexp.quant.fold import constant_value

log = logging.getLogger("qexp")

CENTRE = 32768  # HTP re-centres uint16 activations on 2**15
DROPPED = 256  # the accumulator's low 8 bits, dropped with a floor
MATMUL_DROPPED = 1 << 16  # a 16x16-bit matmul's accumulator keeps multiples of 2**16
SCALE_STEPS = 16  # LPBQ block scales are 4-bit multiples of max_b(s_b) / 16


# what the pass models, tagged on runs (htp_exact_model); a sweep does not resume from a run with another one
MODELLED_OPS = "conv_accumulator_floor,rms_norm_floor,softmax_exp15_floor,sigmoid_15bit_floor,gelu_phi_table"
MODELS = tuple(MODELLED_OPS.split(","))  # each can be left out (model_htp_arithmetic's `models`) to measure it
# measured on the emulator but not where these programs use it, so not part of eval.htp_exact (module docstring);
# the diagnostics can add it
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


def quantize_per_tensor_floor(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
                              dtype: torch.dtype) -> torch.Tensor:
    """quantize_per_tensor with a floor where it rounds to nearest (the same float32 arithmetic otherwise): how HTP
    requantizes a 16-bit RMSNorm's output (module docstring)."""
    return torch.clamp(torch.floor(x * (1.0 / scale)) + zero_point, quant_min, quant_max).to(dtype)


def quantize_sigmoid_fifteen_bits(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
                                  dtype: torch.dtype) -> torch.Tensor:
    """The quantize of a 16-bit sigmoid's output (QNN fixes it at scale 1 / 65536, zero point 0) as HTP computes it:
    15 bits, floored, so the code is 2 * floor(y * 32768) and never odd (module docstring)."""
    half_codes = torch.floor(x * (0.5 / scale))
    return torch.clamp(2 * half_codes + zero_point, quant_min, quant_max - 1).to(dtype)


GELU_PHI_TABLE = Path(__file__).with_name("htp_gelu_phi.csv")  # columns x, phi_4096 (phi in units of 1/4096)


@functools.lru_cache(maxsize=1)
def gelu_phi_table() -> tuple[float, float, torch.Tensor]:
    """(first x, grid step, phi on the grid in units of 1/4096, float64) from GELU_PHI_TABLE."""
    rows = [line.split(",") for line in GELU_PHI_TABLE.read_text().splitlines()[1:] if line.strip()]
    x = torch.tensor([float(r[0]) for r in rows], dtype=torch.float64)
    phi = torch.tensor([float(r[1]) for r in rows], dtype=torch.float64)
    step = (x[1] - x[0]).item()
    if not torch.allclose(x[1:] - x[:-1], torch.full_like(x[1:], step)):
        raise ValueError(f"{GELU_PHI_TABLE}: x must be a uniform grid")
    return x[0].item(), step, phi


def htp_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU as HTP computes it at 16 bits, x * phi(x) with phi interpolated linearly in the measured table and held
    at its end values beyond it (module docstring). `approximate` is ignored, as QNN ignores it."""
    start, step, phi = gelu_phi_table()
    position = ((x.to(torch.float64) - start) / step).clamp(0, phi.numel() - 1)
    left = position.floor().clamp(max=phi.numel() - 2)
    weight = position - left
    left = left.long()
    value = phi[left] * (1 - weight) + phi[left + 1] * weight
    return (x.to(torch.float64) * value / 4096).to(x.dtype)


def htp_softmax(x: torch.Tensor, dim: int, *_, **__) -> torch.Tensor:
    """Softmax as HTP computes it at 16 bits before its floored requantization: exp(x - max) kept as the integer
    floor(2**15 exp(x - max)), divided by the row's sum of them (module docstring). In float32 the integers are exact
    and so is their sum for rows of up to 512 keys (each is at most 2**15), and beyond unless more than 512 of them
    are near the row's max."""
    centred = x - x.amax(dim, keepdim=True)
    fixed = torch.floor(torch.exp(centred) * 32768.0)
    return fixed / fixed.sum(dim, keepdim=True)


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


def htp_matmul(a_q: torch.Tensor, a_scale: float, a_zp: int, b_q: torch.Tensor, b_scale: float) -> torch.Tensor:
    """A matmul of a uint16 activation (zero point a_zp) by an int16 symmetric one as HTP computes it (module
    docstring); float32 output before requantization."""
    a, b = a_q.to(torch.float64), b_q.to(torch.float64)
    kept = torch.floor(torch.matmul(a, b) / MATMUL_DROPPED) * MATMUL_DROPPED
    correction = torch.round(a_zp * b.sum(dim=-2, keepdim=True) / MATMUL_DROPPED) * MATMUL_DROPPED
    return ((kept - correction) * (a_scale * b_scale)).to(torch.float32)


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


def model_htp_arithmetic(module: torch.fx.GraphModule, w4_lowering: str = "lpbq",
                         models: tuple = MODELS) -> ModelledCounts:
    """Replace, in place, every 1x1 convolution / linear with a uint16 input and <= 8-bit symmetric weights by HTP's
    integer arithmetic, floor every 16-bit RMSNorm's output quantization, and give 16-bit softmaxes, sigmoids and
    GELUs HTP's arithmetic (module docstring). Run it before fold_weight_dequantize: it reads the integer weights.
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
        for dead in (x_arg, w_arg):  # the dequantize ops only this layer read, and the weight's constants
            if isinstance(dead, torch.fx.Node) and not dead.users:
                sources = [a for a in dead.all_input_nodes if a.op == "get_attr"]
                graph.erase_node(dead)
                for source in sources:
                    if not source.users:
                        graph.erase_node(source)
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
