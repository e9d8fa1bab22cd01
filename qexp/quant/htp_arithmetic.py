"""HTP's arithmetic for 16-bit-activation convolutions, linears, RMSNorms, softmaxes, sigmoids and GELUs, modelled in
the QDQ program (eval.htp_exact); a candidate model of its matmul for the diagnostics. This module holds the integer
kernels; qexp.quant.htp_arithmetic_pass rewrites a QDQ program with them.

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
from pathlib import Path

import torch

log = logging.getLogger("qexp")

CENTRE = 32768  # HTP re-centres uint16 activations on 2**15
DROPPED = 256  # the accumulator's low 8 bits, dropped with a floor
MATMUL_DROPPED = 1 << 16  # a 16x16-bit matmul's accumulator keeps multiples of 2**16
SCALE_STEPS = 16  # LPBQ block scales are 4-bit multiples of max_b(s_b) / 16


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
