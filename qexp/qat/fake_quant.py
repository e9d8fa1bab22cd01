"""The run's weight grid (qexp/quant/grid.py: QnnQuantizer's symmetric per-channel or LPBQ per-block grid) as a
straight-through fake quantizer on the static llama's conv weights, for training.

Forward: q = clamp(round(w / s), -qmax, qmax) x s with the grid's scales s, fixed when training starts (the
weights' absmax / qmax, LPBQ-rounded, or the exact ranges an earlier algorithm chose: weight_clip, GPTQ), as
upstream freezes its observers after calibration. Backward: the rounding passes the gradient through, the clamp
does not (a weight that rounds beyond the grid's range gets none). With `learn_scales` the per-channel scales train
too (their gradient is LSQ's: round(w/s) - w/s inside the range, +-qmax outside). The final scales go to the quantize
stage as exact weight ranges (range = s x qmax), so the converted program rounds the trained weights exactly as
training did.

Within one optimizer step the weights do not change, so `quantized_once` computes each fake-quantized weight once
for all of the step's micro-batches (a leaf their backward passes accumulate into) and passes the accumulated
gradient straight through to the latent weight at the end of the step: the rounding runs once per step, not once per
sequence, forward and backward.

Activations are not fake-quantized while training: they are re-observed on the trained model by the quantize stage
(16-bit activations add little error next to 4-bit weights; for 8-bit activations this is an approximation).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from qexp.core.errors import ConfigError
from qexp.quant.grid import SCALE_EPS, WeightGrid


def _straight_through(w, s, qmax, g, scale_grad: bool):
    """The gradients of clamp(round(w / s), -qmax, qmax) x s for an output gradient `g`: w's is ((g x s) masked to the
    range) / s, as autograd's chain of mul, clamp and div backward computes it; s's (LSQ) is round(w/s) - w/s inside
    the range and the clamped integer outside, or None."""
    x = w / s
    rounded = torch.round(x)
    inside = (rounded >= -qmax) & (rounded <= qmax)  # clamp's backward, on the rounded value
    grad_w = (g * s) * inside / s
    grad_s = g * torch.where(inside, rounded - x, torch.clamp(rounded, -qmax, qmax)) if scale_grad else None
    return grad_w, grad_s


class _GridRound(torch.autograd.Function):
    """clamp(round(w / s), -qmax, qmax) x s with the straight-through gradient, saving only w and s: autograd's own
    graph of the same expression keeps four weight-sized tensors per layer alive until backward (gigabytes for a
    135M model). Its gradients are autograd's, operation for operation (`_straight_through`)."""

    @staticmethod
    def forward(ctx, w, s, qmax):
        ctx.save_for_backward(w, s)
        ctx.qmax = qmax
        return torch.clamp(torch.round(w / s), -qmax, qmax) * s

    @staticmethod
    def backward(ctx, g):
        w, s = ctx.saved_tensors
        grad_w, grad_s = _straight_through(w, s, ctx.qmax, g, ctx.needs_input_grad[1])
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
        self.held: Optional[torch.Tensor] = None  # the weight quantized once for the current step (quantized_once)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.held is not None:
            return self.held
        flat = w.reshape(w.shape[0], -1)
        return _GridRound.apply(flat, self._expanded(flat.shape[1]), self.grid.qmax).reshape(w.shape)

    def _expanded(self, cols: int) -> torch.Tensor:
        return self.grid.expand(self.scales.clamp(min=SCALE_EPS), cols)

    def trains(self, w: torch.Tensor) -> bool:
        return w.requires_grad or (isinstance(self.scales, nn.Parameter) and self.scales.requires_grad)

    @torch.no_grad()
    def hold(self, w: torch.Tensor, grad: bool) -> None:
        flat = w.reshape(w.shape[0], -1)
        self.held = self.grid.quantize(flat, self.scales.clamp(min=SCALE_EPS)).reshape(w.shape).requires_grad_(grad)

    @torch.no_grad()
    def release(self, w: nn.Parameter) -> None:
        """Drop the held weight; its accumulated gradient goes straight through to `w` (and the learned scales)."""
        held, self.held = self.held, None
        if held is None or held.grad is None:
            return
        flat = w.reshape(w.shape[0], -1)
        learn = isinstance(self.scales, nn.Parameter) and self.scales.requires_grad
        grad_w, grad_s = _straight_through(flat, self._expanded(flat.shape[1]), self.grid.qmax,
                                           held.grad.reshape(flat.shape), learn)
        if w.requires_grad:  # a frozen weight (the lm head) whose scales learn gets none
            _accumulate(w, grad_w.reshape(w.shape))
        if learn:  # through repeat_interleave (a sum over each block) and the clamp at SCALE_EPS
            per_block = grad_s.reshape(flat.shape[0], self.scales.shape[1], -1).sum(-1)
            _accumulate(self.scales, per_block * (self.scales >= SCALE_EPS))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad


@contextmanager
def quantized_once(module: nn.Module, paths, grad: bool):
    """Within: the fake-quantized weights of the modules at `paths` are computed once, from the latent weights as
    they are on entry. With `grad`, the gradient the block's backward passes accumulate goes straight through to the
    latent weights on a normal exit."""
    parts = [(conv.parametrizations["weight"][0], conv.parametrizations["weight"].original)
             for conv in (module.get_submodule(p) for p in paths)]
    for fake_quant, latent in parts:
        fake_quant.hold(latent, grad and fake_quant.trains(latent))
    failed = True
    try:
        yield
        failed = False
    finally:
        for fake_quant, latent in parts:
            if failed:
                fake_quant.held = None
            else:
                fake_quant.release(latent)


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
def detach(module: nn.Module, paths) -> Tuple[Dict[str, torch.Tensor], float]:
    """Remove the fake quantizers, leaving each weight as the student used it: the latent weight rounded onto its
    final scales. The quantize stage observes activation ranges on the model it is given, and the straight-through
    gradient does not tie a latent weight to the value it rounds to (anywhere within its rounding step, or beyond the
    grid's range): from on-grid weights (GPTQ's) the latent float model can be far from the student. Returns the final
    scales by path and the fraction of the trained weights that lay beyond their grid's range."""
    scales, outside, total = {}, 0, 0
    for path in paths:
        conv = module.get_submodule(path)
        fake_quant, latent = conv.parametrizations["weight"][0], conv.parametrizations["weight"].original
        scales[path] = fake_quant.scales.detach().clamp(min=SCALE_EPS).clone()
        if latent.requires_grad:
            flat = latent.reshape(latent.shape[0], -1)
            rounded = torch.round(flat / fake_quant.grid.expand(scales[path], flat.shape[1]))
            outside += int((rounded.abs() > fake_quant.grid.qmax).sum())
            total += flat.numel()
        parametrize.remove_parametrizations(conv, "weight", leave_parametrized=True)
    return scales, outside / max(total, 1)
