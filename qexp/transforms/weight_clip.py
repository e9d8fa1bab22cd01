"""Weight clipping by error search: per output channel (and block) the scale on the QNN grid that minimises the
rounding error of the weights themselves, instead of absmax / qmax.

This is the GPTQ reference implementation's `Quantizer(mse=True)` (gptq/quant.py `find_params`, the `--w_clip`
option QuaRot runs RTN and GPTQ with): shrink the range by p in {1, 1 - 1/n_grid, ...} > 1 - max_shrink and keep, per
row, the p minimising sum |Q(w) - w|^norm, with the reference's defaults n_grid 100, max_shrink 0.8, norm 2.4 (a norm
above 2 weighs the large errors of clipped outliers more than the mean square does). It needs no calibration data.

On HTP's LPBQ block grid a block scale is a 4-bit multiple (1..16) of its row's unit (qexp/quant/lpbq.py), so the
candidates are those steps, as in AWQ's clip search: the row's largest block keeps its 16 steps (clipping it would
change the unit of every block in the row) and the others may go down to (1 - max_shrink) of their absmax.

The chosen scales reach the quantizer as exact weight ranges (LoadedModel.weight_ranges, range = scale x qmax, as
GPTQ's do); the float weights are not changed, so the transformed float model is the original one.

With `objective: outputs` the error judged is the layer's output error on the calibration tokens instead of the
weights' own: per row (and block) sum over tokens of ((Q(w) - w) . x)^2 = d H d^T with H = X^T X of the linear's
inputs (per block its diagonal block, the block's partial output error, as llm-awq's clip search judges it). The
weights' own error treats every input channel alike; SmolLM2's few massive activation channels make a small weight
error there a large output error, and that is where clipping by the weights' error hurts (layer 2's down projection
12x the output error of absmax on held-out tokens: diagnostics/diag_gptq_heldout.py). The inputs are the float
model's (as AWQ's): the search needs calibration data only then.

`algorithm=[weight_clip]` is round-to-nearest onto the searched scales; `algorithm=[weight_clip,gptq]` is GPTQ
rounding onto them (QuaRot's GPTQ with --w_clip). Transforms that change weights (rotation, AWQ, SmoothQuant) must
come before it: the scales are chosen for the weights it sees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
from tqdm import tqdm

from qexp.core.config import BlockScaleRounding
from qexp.core.errors import ConfigError
from qexp.quant.lpbq import SCALE_STEPS
from qexp.transforms.base import GridSearchTransform, TransformConfig, register_transform
from qexp.transforms.capture import LayerByLayer, input_of
from qexp.quant.grid import SCALE_EPS, WeightGrid, grid_for, layer_linears

# the GPTQ reference's Quantizer.configure defaults
N_GRID, MAX_SHRINK, NORM = 100, 0.8, 2.4
OBJECTIVES = ("weights", "outputs")


@dataclass
class WeightClipConfig(TransformConfig):
    n_grid: int = N_GRID  # shrink factors 1, 1 - 1/n_grid, ...
    max_shrink: float = MAX_SHRINK  # down to (1 - max_shrink) of absmax
    norm: float = NORM  # the error's exponent: sum |Q(w) - w|^norm (objective weights)
    # weights: the weights' own rounding error (no calibration); outputs: the output error on the calibration tokens
    objective: str = "weights"


def clip_candidates(original_max: torch.Tensor, grid: WeightGrid, n_grid: int,
                    max_shrink: float) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(max |w|, scale) candidates per (block, output channel): `original_max` is [blocks, out, 1], each candidate's
    tensors have its shape. Shrink factors of absmax on a float grid; LPBQ steps on a block grid with quantized
    block scales."""
    if grid.block_size and grid.block_scale_rounding != BlockScaleRounding.float:
        return _lpbq_clip_candidates(original_max, grid, max_shrink)
    return [(m, m / grid.qmax) for m in
            (original_max * (1 - step / n_grid) for step in range(int(max_shrink * n_grid)))]


def _lpbq_clip_candidates(original_max: torch.Tensor, grid: WeightGrid,
                          max_shrink: float) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Clip candidates that are LPBQ block scales (qexp/quant/lpbq.py): with per-block scales stored as q * unit
    (q = 1..16, unit = the row's largest block scale / 16), shrinking a block's max between two steps changes nothing
    on HTP, and the step the observer then picks must be the one searched. Per block, the candidates are the steps
    q * unit * qmax from the step its unclipped max gets down to (1 - max_shrink) of that max; the row's largest block
    keeps its max (clipping it would change the unit of every block in the row). Each candidate is (max |w|, scale),
    both [blocks, out, 1] like `original_max`; blocks with fewer candidates repeat their last one."""
    scales = original_max / grid.qmax  # [blocks, out, 1] float block scales
    unit = scales.amax(0, keepdim=True) / SCALE_STEPS  # [1, out, 1]: per output channel, over its blocks
    ratio = scales / unit
    top = torch.ceil(ratio - 1e-4) if grid.block_scale_rounding == BlockScaleRounding.up else torch.round(ratio)
    top = top.clamp(1, SCALE_STEPS)
    lowest = torch.ceil(ratio * (1 - max_shrink) - 1e-4).clamp(min=1)
    is_row_max = scales >= scales.amax(0, keepdim=True)
    candidates = []
    for drop in range(SCALE_STEPS):
        steps = torch.maximum(top - drop, lowest)
        steps = torch.where(is_row_max, top, steps)
        # a step at or above the unclipped max is no clip (the observer then picks that step itself)
        candidates.append((torch.minimum(steps * unit * grid.qmax, original_max), steps * unit))
    return candidates


def _search_scales(w: torch.Tensor, grid: WeightGrid, n_grid: int, max_shrink: float,
                   error: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per (output channel, block) the clip candidate whose rounding error d = Q(w) - w ([blocks, out, size]) has the
    least `error(d)` ([blocks, out, 1]): [out, n_blocks], like WeightGrid.scales (the no-clip candidate is always
    among them, so the error is never above absmax's)."""
    out, cols = w.shape
    size = grid.block_size or cols
    if cols % size:
        raise ValueError(f"block_size {size} does not divide the layer's {cols} input channels")
    wb = w.float().reshape(out, cols // size, size).transpose(0, 1)  # [blocks, out, size]
    original_max = wb.abs().amax(-1, keepdim=True)
    best_scale = torch.zeros_like(original_max)
    best_err = torch.full_like(original_max, float("inf"))
    for _, scale in clip_candidates(original_max, grid, n_grid, max_shrink):
        scale = scale.clamp(min=SCALE_EPS)
        err = error(torch.clamp(torch.round(wb / scale), -grid.qmax, grid.qmax) * scale - wb)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale.squeeze(-1).transpose(0, 1).contiguous()


@torch.no_grad()
def mse_scales(w: torch.Tensor, grid: WeightGrid, n_grid: int = N_GRID, max_shrink: float = MAX_SHRINK,
               norm: float = NORM) -> torch.Tensor:
    """Per (output channel, block) the candidate scale minimising sum |Q(w) - w|^norm over the block:
    [out, n_blocks]."""
    return _search_scales(w, grid, n_grid, max_shrink, lambda d: d.abs().pow(norm).sum(-1, keepdim=True))


def block_gram(x: torch.Tensor, size: int) -> torch.Tensor:
    """H_b = x_b^T x_b of the inputs x [tokens, in] per block of `size` input channels: [blocks, size, size]."""
    xb = x.double().reshape(x.shape[0], -1, size).transpose(0, 1)  # [blocks, tokens, size]
    return (xb.transpose(1, 2) @ xb).float()


@torch.no_grad()
def output_mse_scales(w: torch.Tensor, gram: torch.Tensor, grid: WeightGrid, n_grid: int = N_GRID,
                      max_shrink: float = MAX_SHRINK) -> torch.Tensor:
    """Per (output channel, block) the candidate scale minimising the block's partial output error on the inputs
    x: sum_t ((Q(w_b) - w_b) . x_tb)^2 = d_b H_b d_b^T, with `gram` = block_gram(x, block size). [out, n_blocks]."""
    return _search_scales(w, grid, n_grid, max_shrink, lambda d: (torch.bmm(d, gram) * d).sum(-1, keepdim=True))


@register_transform
class WeightClip(GridSearchTransform):
    """Round-to-nearest with each row's (and block's) scale searched against its own rounding error."""

    name = "weight_clip"
    config_class = WeightClipConfig
    sets_weight_ranges = True
    rounds_weights = True  # the weights stay; their scales are chosen
    needs_calibration = False
    needs_grid_because = "searches scales on a quantization grid"

    def __init__(self, config):
        super().__init__(config)
        self.needs_calibration = config.objective == "outputs"  # the output error needs the layers' inputs

    def validate(self, cfg) -> None:
        super().validate(cfg)
        c = self.config
        if c.n_grid < 1 or not 0 < c.max_shrink < 1 or c.norm <= 0:
            raise ConfigError(f"algorithm.weight_clip: n_grid={c.n_grid}, max_shrink={c.max_shrink}, norm={c.norm}",
                              "use n_grid >= 1, 0 < max_shrink < 1 and norm > 0")
        if c.objective not in OBJECTIVES:
            raise ConfigError(f"algorithm.weight_clip.objective={c.objective!r}", f"use one of {', '.join(OBJECTIVES)}")

    def apply(self, model, context):
        c = self.config
        ranges = dict(model.weight_ranges)
        runner, device = None, context.device or torch.device("cpu")
        if c.objective == "outputs":  # the float model's inputs, layer by layer
            from qexp.models.static_llama import StaticLlama

            static = StaticLlama.private_copy(model, context.cfg.export.max_context_len, context.cfg.model)
            runner = LayerByLayer(static, context.calibration.samples, device)
        for i in tqdm(range(model.params["n_layers"]), desc="weight_clip", unit="layer", leave=False):
            inputs = runner.run(i) if runner is not None else None
            grams = {}  # (input, block size) -> H blocks: q/k/v and gate/up read the same input
            for key in layer_linears(i):
                grid = grid_for(context.cfg.quant, key)
                if grid is None or grid.bits >= 16:
                    continue
                w = model.state_dict[key].to(device)
                if inputs is None:
                    scales = mse_scales(w, grid, c.n_grid, c.max_shrink, c.norm)
                else:
                    gram_key = (input_of(key), grid.block_size or w.shape[1])
                    if gram_key not in grams:
                        grams[gram_key] = block_gram(inputs[gram_key[0]], gram_key[1])
                    scales = output_mse_scales(w, grams[gram_key], grid, c.n_grid, c.max_shrink)
                ranges[key] = (scales * grid.qmax).cpu()
        return dataclasses.replace(model, weight_ranges=ranges)
