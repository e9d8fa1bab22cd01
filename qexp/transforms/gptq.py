"""GPTQ: error-compensating rounding with the inputs' Hessian (Frantar et al. 2022, arXiv:2210.17323), on the
QNN weight grid, with the exact scales handed to QnnQuantizer.

Per linear, with H = 2 X^T X of its calibration inputs (+ `damp` x mean(diag H) on the diagonal), columns are
quantized one at a time and each column's error e = (w - q) / [H^-1]_jj is spread over the not-yet-quantized columns
through the upper Cholesky factor of H^-1 (the paper's Algorithm 1, with its lazy batch updates of `block_size`
columns and optional act-order: columns by decreasing diag H). Layers are processed in order, each layer's inputs
captured from the model whose earlier layers are already quantized (the reference implementation's sequential mode).

The grid is QnnQuantizer's (qexp/quant/grid.py). Per-channel scales are fixed before the updates, from the
original weights (as the reference does without groups). Per-block scales are, as in the reference implementation's
`groupsize` mode, chosen when GPTQ reaches each block, from the block's weights as the earlier columns' error
updates left them (`static_groups=true`: all from the original weights, which act-order needs to keep QNN's block
layout). In column order with static block scales the updates push weights past their block's range and the clipped
error cascades, hence the dynamic ones. The dynamic block scales stay on HTP's LPBQ grid: the row's unit (largest
original block scale / 16) is kept, each block's 4-bit multiple is chosen from its current weights, and the block
holding the row's largest original scale keeps 16 units, so the lowering's re-encoding of the scales is the
identity.
act_order (default true) visits the columns by decreasing diag H and therefore uses static block scales. It is the
default because on SmolLM2 it is what makes GPTQ beat round-to-nearest: in column order the down projections overfit
the calibration Hessian (docs/research/2026-11-25-algorithms-smollm2.md has the figures).
After `weight_clip` (`algorithm=[weight_clip,gptq]`, QuaRot's GPTQ with --w_clip) GPTQ rounds onto the scales it
chose, all fixed before the updates, instead of absmax / qmax.
Because a row whose updated weights never reach +-qmax would be re-observed by QnnQuantizer with a smaller scale, the
scales go to the quantize stage as exact weight ranges (LoadedModel.weight_ranges, range = scale x qmax): the
converted program's integers are GPTQ's.

Written here: torchao's GPTQ asserts CUDA; llm-compressor's and gptqmodel's run on CPU but on a [-8, 7] grid with
their own scales, on the HF layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from qexp.core.config import BlockScaleRounding
from qexp.core.errors import ConfigError
from qexp.quant.lpbq import SCALE_STEPS, scale_steps
from qexp.transforms.base import GridSearchTransform, TransformConfig, register_transform
from qexp.transforms.capture import LayerByLayer, input_of
from qexp.quant.grid import SCALE_EPS, WeightGrid, grid_for, layer_linears



@dataclass
class GptqConfig(TransformConfig):
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # columns per lazy batch update (speed only; the result is the same)
    act_order: bool = True  # columns by decreasing diag H (with static block scales): see the module docstring
    # per-block grids: every block's scale from the original weights (true), or when GPTQ reaches the block, from its
    # updated weights (false, the reference's groupsize mode); act_order always uses static ones (it visits columns
    # out of block order)
    static_groups: bool = False


def hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 2.0 * x.T @ x / x.shape[0]


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, grid: WeightGrid, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False, static_groups: bool = False, scales: Optional[torch.Tensor] = None):
    """GPTQ one weight [out, in] given H [in, in]. Returns (quantized weight, scales [out, n_blocks]). `scales`
    ([out, n_blocks], e.g. weight_clip's): round onto these, all fixed before the updates; default absmax / qmax."""
    w = w.double().clone()
    h = h.double().clone()
    given = scales is not None
    scales = (scales.double().clone() if given else grid.scales(w.float()).double())
    column_scale = grid.expand(scales, w.shape[1])
    dynamic = bool(grid.block_size) and not static_groups and not act_order and not given
    if dynamic:  # lazy batches made of whole blocks, so a block's current weights are all in the batch's working copy
        block_size = max(grid.block_size, block_size // grid.block_size * grid.block_size)
        lpbq = LpbqRow(scales) if grid.block_scale_rounding != BlockScaleRounding.float else None
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(w.shape[1], device=w.device)
    w, h, column_scale = w[:, perm], h[perm][:, perm], column_scale[:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    cols = w.shape[1]
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if dynamic and (i1 + i) % grid.block_size == 0:
                b = (i1 + i) // grid.block_size
                current = (w1[:, i:i + grid.block_size].abs().amax(-1) / grid.qmax).clamp(min=SCALE_EPS)
                scales[:, b] = lpbq.encode(current, b, grid.block_scale_rounding) if lpbq is not None else current
                column_scale[:, i1 + i:i1 + i + grid.block_size] = scales[:, b:b + 1]
            column, s = w1[:, i], column_scale[:, i1 + i]
            qc = torch.clamp(torch.round(column / s), -grid.qmax, grid.qmax) * s
            q[:, i1 + i] = qc
            e = (column - qc) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(perm)]
    return q.float(), scales.float()


class LpbqRow:
    """HTP's LPBQ block scales for dynamically chosen blocks: each row keeps the unit of its original scales (largest
    block scale / 16) and the block that set it keeps 16 units, so the final scales' largest is still 16 units and
    ExecuTorch's re-encoding at lowering (unit = largest / 16, steps rounded) returns them unchanged."""

    def __init__(self, original_scales: torch.Tensor):
        self.unit = original_scales.amax(-1) / SCALE_STEPS
        self.anchor = original_scales.argmax(-1)

    def encode(self, scale: torch.Tensor, block: int, rounding: BlockScaleRounding) -> torch.Tensor:
        steps = scale_steps(scale / self.unit, rounding)
        return torch.where(self.anchor == block, torch.full_like(steps, SCALE_STEPS), steps) * self.unit


@register_transform
class Gptq(GridSearchTransform):
    name = "gptq"
    config_class = GptqConfig
    version = 2  # 2: per-block scales chosen when GPTQ reaches each block (static_groups=false)
    sets_weight_ranges = True  # its scales, exactly (the module docstring)
    uses_weight_ranges = True  # rounds onto the scales an earlier weight_clip chose
    rounds_weights = True
    needs_grid_because = "rounds weights onto a quantization grid"

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if not 0 <= self.config.damp < 1 or self.config.block_size < 1:
            raise ConfigError(f"algorithm.gptq: damp={self.config.damp}, block_size={self.config.block_size}",
                              "use 0 <= damp < 1 and block_size >= 1")

    def apply(self, model, context):
        cfg, config = context.cfg, self.config
        state = dict(model.state_dict)
        ranges = dict(model.weight_ranges)
        from qexp.models.static_llama import StaticLlama

        static = StaticLlama.private_copy(model, cfg.export.max_context_len, cfg.model)
        runner = LayerByLayer(static, context.calibration.samples, context.device)
        for i in tqdm(range(model.params["n_layers"]), desc="gptq", unit="layer", leave=False):
            x = runner.run(i, advance=False)
            hessians = {name: hessian(v) for name, v in x.items()}
            for key in layer_linears(i):
                grid = grid_for(cfg.quant, key)
                if grid is None or grid.bits >= 16:
                    continue
                h = hessians[input_of(key)]
                given = model.weight_ranges[key].to(h.device) / grid.qmax if key in model.weight_ranges else None
                q, scales = gptq_quantize(state[key].to(h.device), h, grid, config.damp, config.block_size,
                                          config.act_order, config.static_groups, given)
                state[key], ranges[key] = q.cpu(), (scales * grid.qmax).cpu()  # the model's tensors stay on the CPU
            static.update_weights({k: state[k] for k in layer_linears(i)})
            runner.run(i, inputs=(), advance=True)  # the next layer reads this layer's quantized outputs
        return dataclasses.replace(model, state_dict=state, weight_ranges=ranges)
