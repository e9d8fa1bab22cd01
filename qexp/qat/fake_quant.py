"""The run's weight grid (qexp/transforms/grid.py: QnnQuantizer's symmetric per-channel or LPBQ per-block grid) as a
straight-through fake quantizer on the static llama's conv weights, for training.

Forward: q = clamp(round(w / s), -qmax, qmax) x s with the grid's scales s, fixed when training starts (the
weights' absmax / qmax, LPBQ-rounded, or the exact ranges an earlier algorithm chose: weight_clip, GPTQ), as
upstream freezes its observers after calibration. Backward: the rounding passes the gradient through, the clamp
does not (a weight beyond the grid's range gets none). With `learn_scales` the per-channel scales train too (their
gradient is LSQ's: round(w/s) - w/s inside the range, +-qmax outside). The final scales go to the quantize stage as
exact weight ranges (range = s x qmax), so the converted program rounds the trained weights exactly as training did.

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


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


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
        q = torch.clamp(_round_ste(flat / s), -self.grid.qmax, self.grid.qmax) * s
        return q.reshape(w.shape)


def attach(module: nn.Module, grids: Dict[str, WeightGrid], initial_scales: Dict[str, torch.Tensor],
           learn_scales: bool) -> Dict[str, GridFakeQuant]:
    """Register a GridFakeQuant on each module `path` of `grids` (static module paths, e.g. layers.0.attention.wq_conv),
    scales from `initial_scales` ([out, n_blocks], by path). Returns them by path."""
    attached = {}
    for path, grid in grids.items():
        if learn_scales and grid.block_size:  # the transform's validate() refuses this config before any work
            raise ConfigError(f"algorithm.qat.learn_scales=true and {path} has a per-block (LPBQ) grid",
                              "use learn_scales=false, or a per-channel scheme (quant=16a4w)")
        conv = module.get_submodule(path)
        fake_quant = GridFakeQuant(grid, initial_scales[path].to(conv.weight.dtype), learn_scales)
        parametrize.register_parametrization(conv, "weight", fake_quant, unsafe=True)
        attached[path] = fake_quant
    return attached


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
