"""The run's weight grid (qexp/transforms/grid.py: QnnQuantizer's symmetric per-channel or LPBQ per-block grid) as a
straight-through fake quantizer on the static llama's conv weights, for training.

Forward: q = clamp(round(w / s), -qmax, qmax) x s with the grid's scales s, fixed when training starts (the
weights' absmax / qmax, LPBQ-rounded, or the exact ranges an earlier algorithm chose: weight_clip, GPTQ), as
upstream freezes its observers after calibration. Backward: the rounding passes the gradient through, the clamp
does not (a weight that rounds beyond the grid's range gets none). With `learn_scales` the per-channel scales train
too (their gradient is LSQ's: round(w/s) - w/s inside the range, +-qmax outside). The final scales go to the quantize
stage as exact weight ranges (range = s x qmax), so the converted program rounds the trained weights exactly as
training did.

Activations are not fake-quantized while training: they are re-observed on the trained model by the quantize stage
(16-bit activations add little error next to 4-bit weights; for 8-bit activations this is an approximation).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn
from torch.nn.utils import parametrize

from qexp.errors import ConfigError
from qexp.transforms.grid import SCALE_EPS, WeightGrid


class _GridRound(torch.autograd.Function):
    """clamp(round(w / s), -qmax, qmax) x s with the straight-through gradient, saving only w and s: autograd's own
    graph of the same expression keeps four weight-sized tensors per layer alive until backward (gigabytes for a
    135M model). Its gradients are autograd's, operation for operation: w's is ((g x s) masked to the range) / s, as
    the chain of mul, clamp and div backward computes it, so the trained weights do not depend on which is used."""

    @staticmethod
    def forward(ctx, w, s, qmax):
        ctx.save_for_backward(w, s)
        ctx.qmax = qmax
        return torch.clamp(torch.round(w / s), -qmax, qmax) * s

    @staticmethod
    def backward(ctx, g):
        w, s = ctx.saved_tensors
        x = w / s
        rounded = torch.round(x)
        inside = (rounded >= -ctx.qmax) & (rounded <= ctx.qmax)  # clamp's backward, on the rounded value
        grad_w = (g * s) * inside / s
        grad_s = None
        if ctx.needs_input_grad[1]:  # LSQ: round(x) - x inside the range, the clamped integer outside
            grad_s = g * torch.where(inside, rounded - x, torch.clamp(rounded, -ctx.qmax, ctx.qmax))
        return grad_w, grad_s, None


class GridFakeQuant(nn.Module):
    """Parametrization of a conv weight [out, in, 1, 1] (or a linear's [out, in]) onto `grid` with `scales`
    [out, n_blocks]."""

    def __init__(self, grid: WeightGrid, scales: torch.Tensor, learn_scales: bool):
        super().__init__()
        self.grid = grid
        if learn_scales:
            self.scales = nn.Parameter(scales.clone())
        else:
            self.register_buffer("scales", scales.clone())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        flat = w.reshape(w.shape[0], -1)
        s = self.grid.expand(self.scales.clamp(min=SCALE_EPS), flat.shape[1])
        return _GridRound.apply(flat, s, self.grid.qmax).reshape(w.shape)


def attach(module: nn.Module, grids: Dict[str, WeightGrid], initial_scales: Dict[str, torch.Tensor],
           learn_scales: bool) -> None:
    """Register a GridFakeQuant on each module `path` of `grids` (static module paths, e.g. layers.0.attention.wq_conv),
    scales from `initial_scales` ([out, n_blocks], by path)."""
    for path, grid in grids.items():
        if learn_scales and grid.block_size:  # the transform's validate() refuses this config before any work
            raise ConfigError(f"algorithm.qat.learn_scales=true and {path} has a per-block (LPBQ) grid",
                              "use learn_scales=false, or a per-channel scheme (quant=16a4w)")
        conv = module.get_submodule(path)
        fake_quant = GridFakeQuant(grid, initial_scales[path].to(conv.weight.dtype), learn_scales)
        parametrize.register_parametrization(conv, "weight", fake_quant, unsafe=True)


@torch.no_grad()
def detach(module: nn.Module, paths) -> Dict[str, torch.Tensor]:
    """Remove the fake quantizers, keeping the trained float weights (not rounded: the quantize stage rounds them onto
    the same scales). Returns the final scales by path."""
    scales = {}
    for path in paths:
        conv = module.get_submodule(path)
        fake_quant = conv.parametrizations["weight"][0]
        scales[path] = fake_quant.scales.detach().clamp(min=SCALE_EPS).clone()
        parametrize.remove_parametrizations(conv, "weight", leave_parametrized=False)
    return scales
