"""GPTQ: error-compensating rounding with the inputs' Hessian (Frantar et al. 2022, arXiv:2210.17323), on the
QNN weight grid, with the exact scales handed to QnnQuantizer.

Per linear, with H = 2 X^T X of its calibration inputs (+ `damp` x mean(diag H) on the diagonal), columns are
quantized one at a time and each column's error e = (w - q) / [H^-1]_jj is spread over the not-yet-quantized columns
through the upper Cholesky factor of H^-1 (the paper's Algorithm 1, with its lazy batch updates of `block_size`
columns and optional act-order: columns by decreasing diag H). Layers are processed in order, each layer's inputs
captured from the model whose earlier layers are already quantized (the reference implementation's sequential mode).

The grid is QnnQuantizer's (qexp/transforms/grid.py), with scales fixed before the updates from the original weights
(per channel or per block of input channels: "static groups", so act-order keeps QNN's block layout). Because a row
whose updated weights never reach +-qmax would be re-observed by QnnQuantizer with a smaller scale, the scales go to
the quantize stage as exact weight ranges (LoadedModel.weight_ranges, range = scale x qmax): the converted program's
integers are GPTQ's.

Written here: torchao's GPTQ asserts CUDA; llm-compressor's and gptqmodel's run on CPU but on a [-8, 7] grid with
their own scales, on the HF layout (../shared/reference/algorithm-libraries.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tqdm import tqdm

from qexp.errors import ConfigError
from qexp.transforms.base import GridSearchTransform, TransformConfig, register_transform
from qexp.transforms.capture import LayerByLayer, private_static
from qexp.transforms.grid import WeightGrid, grid_for, layer_linears

# which captured input each linear reads
INPUT_OF = {"wq": "attn_in", "wk": "attn_in", "wv": "attn_in", "wo": "o_in", "w1": "ffn_in", "w3": "ffn_in",
            "w2": "down_in"}


@dataclass
class GptqConfig(TransformConfig):
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # columns per lazy batch update (speed only; the result is the same)
    act_order: bool = False


def hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 2.0 * x.T @ x / x.shape[0]


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, grid: WeightGrid, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False):
    """GPTQ one weight [out, in] given H [in, in]. Returns (quantized weight, scales [out, n_blocks])."""
    w = w.double().clone()
    h = h.double().clone()
    scales = grid.scales(w.float()).double()
    column_scale = grid.expand(scales, w.shape[1])
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(w.shape[1])
    w, h, column_scale = w[:, perm], h[perm][:, perm], column_scale[:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    cols = w.shape[1]
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column, s = w1[:, i], column_scale[:, i1 + i]
            qc = torch.clamp(torch.round(column / s), -grid.qmax, grid.qmax) * s
            q[:, i1 + i] = qc
            e = (column - qc) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(perm)]
    return q.float(), scales.float()


@register_transform
class Gptq(GridSearchTransform):
    name = "gptq"
    config_class = GptqConfig
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
        static = private_static(model, cfg.export.max_context_len, cfg.model.r3)
        runner = LayerByLayer(static, context.calibration.samples)
        for i in tqdm(range(model.params["n_layers"]), desc="gptq", unit="layer", leave=False):
            x = runner.run(i, advance=False)
            hessians = {name: hessian(v) for name, v in x.items()}
            for key in layer_linears(i):
                grid = grid_for(cfg.quant, key)
                if grid is None or grid.bits >= 16:
                    continue
                h = hessians[INPUT_OF[key.rsplit(".", 2)[1]]]
                state[key], scales = gptq_quantize(state[key], h, grid, config.damp, config.block_size,
                                                   config.act_order)
                ranges[key] = scales * grid.qmax
            static.update_weights({k: state[k] for k in layer_linears(i)})
            runner.run(i, inputs=(), advance=True)  # the next layer reads this layer's quantized outputs
        return dataclasses.replace(model, state_dict=state, weight_ranges=ranges)
