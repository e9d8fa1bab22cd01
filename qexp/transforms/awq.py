"""AWQ: activation-aware weight scaling (Lin et al. 2023, arXiv:2306.00978), searched on the QNN weight grid.

For each group of linears that read the same input X (q/k/v after the attention norm, gate/up after the FFN norm,
down after up, and v -> o when q and kv heads match), AWQ picks a per-input-channel scale s minimising the paper's
objective (its Eq. 4-5)

    L(s) = || Q(W diag(s)) (diag(s)^-1 X) - W X ||^2      over the group's linears,

with s = s_X^a / s_W^(1-a) (a on a grid of `n_grid` points in [0, 1); `duo_scaling`, as llm-awq/AutoAWQ) or
s = s_X^a, where s_X is the mean |x| of each input channel and s_W the mean normalised |w|; s is normalised by
sqrt(max(s) min(s)). The scale is folded into the preceding op (norm weight / s, or the previous linear's rows / s),
so the float model keeps its function. Q is the grid QnnQuantizer will use for that layer (qexp/quant/grid.py:
symmetric, [-qmax, qmax], per channel or per block), not a generic asymmetric one.

Then, with `clip`, llm-awq's weight clipping: per output channel (and block), the max |w| is shrunk by the factor
in {1, 1 - 1/clip_grid, ...} >= 1 - clip_max_shrink that minimises the block's partial output error; q and k are not
clipped (llm-awq: their error passes through the q.k product). Clipping changes the float function on purpose.

Written here rather than imported: llm-awq needs CUDA; llm-compressor's AWQ runs on CPU only with patches, on the HF
layout, and on its own [-8, 7] grid; torchao's is per linear (q, k, v would need three scales for one norm). This
module works on qexp's Meta layout, so it composes with rotations.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from tqdm import tqdm

from qexp.core.errors import ConfigError
from qexp.transforms.base import GridSearchTransform, TransformConfig, register_transform
from qexp.transforms.capture import LayerByLayer
from qexp.quant.grid import WeightGrid, grid_for
from qexp.transforms.weight_clip import clip_candidates

log = logging.getLogger("qexp")


@dataclass
class AwqConfig(TransformConfig):
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    clip_tokens: int = 512  # calibration tokens (evenly subsampled) for the clip search, as llm-awq
    # Calibration samples on which a candidate scale's effect on the decoder layer's output is measured (q/k/v and
    # gate/up groups; llm-awq measures the attention / MLP block output: a scale that helps q/k/v's own outputs can
    # hurt after the softmax). The others use the group's own outputs (the paper's Eq. 4).
    loss_samples: int = 4


def mean_abs_normalised(weights: List[torch.Tensor], grid: WeightGrid) -> torch.Tensor:
    """s_W: mean over rows of |w| / max|w| of its block (llm-awq get_weight_scale), per input channel."""
    w = torch.cat(weights)
    out, cols = w.shape
    size = grid.block_size or cols
    groups = w.abs().reshape(out, cols // size, size)
    return (groups / groups.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(out, cols).mean(0)


def awq_loss(weights: List[torch.Tensor], grids: List[WeightGrid], x: torch.Tensor, s: torch.Tensor,
             reference: List[torch.Tensor]) -> float:
    """The paper's L(s): squared error of the group's outputs, Q(W diag(s)) applied to X / s, vs W X."""
    xs = x / s
    total = 0.0
    for w, grid, ref in zip(weights, grids, reference):
        out = xs @ grid.quantize(w * s).T
        total += (out - ref).pow(2).sum().item()
    return total


def search_scale(weights: List[torch.Tensor], grids: List[WeightGrid], x: torch.Tensor, n_grid: int,
                 duo_scaling: bool, loss: Optional[Callable[[torch.Tensor], float]] = None) -> torch.Tensor:
    """argmin_s of `loss` (default: the paper's L(s) on the group's own outputs) over llm-awq's grid of scales.
    Returns s (ones if no candidate beats no scaling)."""
    x_mean = x.abs().mean(0)
    w_mean = mean_abs_normalised(weights, grids[0])
    if loss is None:
        reference = [x @ w.T for w in weights]

        def loss(s):
            return awq_loss(weights, grids, x, s, reference)

    best, best_loss = torch.ones_like(x_mean), loss(torch.ones_like(x_mean))
    for step in range(n_grid):
        a = step / n_grid
        s = x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4) if duo_scaling else x_mean.pow(a)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        candidate_loss = loss(s)
        if candidate_loss < best_loss:
            best, best_loss = s, candidate_loss
    return best


def search_clip(w: torch.Tensor, grid: WeightGrid, x: torch.Tensor, n_grid: int, max_shrink: float) -> torch.Tensor:
    """llm-awq auto_clip_layer on the QNN grid: per (output channel, block) the max |w| minimising the block's partial
    output error. Returns the clipped weight."""
    out, cols = w.shape
    size = grid.block_size or cols
    blocks = cols // size
    wb = w.reshape(out, blocks, size).transpose(0, 1)  # [blocks, out, size]
    xb = x.reshape(-1, blocks, size).permute(1, 2, 0)  # [blocks, size, tokens]
    reference = torch.bmm(wb, xb)  # partial outputs per block
    original_max = wb.abs().amax(-1, keepdim=True)  # [blocks, out, 1]
    candidates = clip_candidates(original_max, grid, n_grid, max_shrink)
    best_max = original_max.clone()
    best_err = torch.full(original_max.shape, float("inf"), device=w.device)
    for max_val, scale in candidates:
        clipped = torch.maximum(torch.minimum(wb, max_val), -max_val)
        scale = scale.clamp(min=torch.finfo(torch.float32).eps)
        quantized = torch.clamp(torch.round(clipped / scale), -grid.qmax, grid.qmax) * scale
        err = (torch.bmm(quantized, xb) - reference).pow(2).mean(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    clipped = torch.maximum(torch.minimum(wb, best_max), -best_max)
    return clipped.transpose(0, 1).reshape(out, cols)


@register_transform
class Awq(GridSearchTransform):
    name = "awq"
    version = 3  # 2: q/k/v and gate/up scales judged on the decoder layer's output; 3: LPBQ-aware clip search
    config_class = AwqConfig

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if not 1 <= self.config.n_grid <= 1000 or not 0 < self.config.clip_max_shrink < 1:
            raise ConfigError(f"algorithm.awq: n_grid={self.config.n_grid}, clip_max_shrink="
                              f"{self.config.clip_max_shrink}", "use 1 <= n_grid <= 1000 and 0 < clip_max_shrink < 1")

    def apply(self, model, context):
        cfg, config = context.cfg, self.config
        params = model.params
        state = dict(model.state_dict)
        # Every layer's inputs come from the float model, as in llm-awq (scaling keeps the function; clipping is
        # applied to the weights afterwards and not propagated), so one layer-by-layer pass serves all layers.
        from qexp.models.static_llama import StaticLlama

        static = StaticLlama.private_copy(model, cfg.export.max_context_len, cfg.model)
        runner = LayerByLayer(static, context.calibration.samples, context.device)
        group_o = params["n_heads"] == params.get("n_kv_heads", params["n_heads"])
        for i in tqdm(range(params["n_layers"]), desc="awq", unit="layer", leave=False):
            x = runner.run(i, advance=False)
            layer_loss = _LayerOutputLoss(static, runner, i, config.loss_samples)
            att, ffn = f"layers.{i}.attention", f"layers.{i}.feed_forward"
            layer_keys = [k for k in state if k.startswith(f"layers.{i}.")]
            state.update({k: state[k].to(runner.device) for k in layer_keys})  # computed where the inputs are
            groups = [(f"layers.{i}.attention_norm.weight", [f"{att}.wq.weight", f"{att}.wk.weight",
                                                             f"{att}.wv.weight"], "attn_in", True),
                      (f"layers.{i}.ffn_norm.weight", [f"{ffn}.w1.weight", f"{ffn}.w3.weight"], "ffn_in", True),
                      (f"{ffn}.w3.weight", [f"{ffn}.w2.weight"], "down_in", False)]
            if group_o:  # v -> o needs one o input channel per v row (no grouped-query sharing)
                groups.append((f"{att}.wv.weight", [f"{att}.wo.weight"], "o_in", False))
            for previous, names, input_name, through_layer in groups:
                grids = [grid_for(cfg.quant, n) for n in names]
                weights = [state[n] for n in names]
                loss = layer_loss.of_scales(names, grids, weights) if through_layer else None
                s = search_scale(weights, grids, x[input_name], config.n_grid, config.duo_scaling, loss)
                for n in names:
                    state[n] = state[n] * s
                # the op before: a norm weight (vector) or the previous linear's output rows
                state[previous] = state[previous] / (s if state[previous].dim() == 1 else s[:, None])
                x[input_name] = x[input_name] / s
                static.update_weights({k: state[k] for k in (*names, previous)})  # same function, new weights
            if config.clip:
                for names, input_name in (([f"{att}.wv.weight"], "attn_in"), ([f"{att}.wo.weight"], "o_in"),
                                          ([f"{ffn}.w1.weight", f"{ffn}.w3.weight"], "ffn_in"),
                                          ([f"{ffn}.w2.weight"], "down_in")):
                    tokens = _subsample(x[input_name], config.clip_tokens)
                    for n in names:
                        state[n] = search_clip(state[n], grid_for(cfg.quant, n), tokens, config.clip_grid,
                                               config.clip_max_shrink)
            runner.run(i, inputs=(), advance=True)  # the module holds the scaled, unclipped (float) layer
            state.update({k: state[k].cpu() for k in layer_keys})
        return dataclasses.replace(model, state_dict=state)


class _LayerOutputLoss:
    """Mean squared error of decoder layer `layer`'s output over the first `n_samples` calibration samples when some
    of its weights are replaced (then restored), against its output with the current weights."""

    def __init__(self, static, runner: LayerByLayer, layer: int, n_samples: int):
        self.static, self.runner, self.layer = static, runner, layer
        self.samples = range(min(n_samples, len(runner.hidden)))
        self.reference = self._output()

    @torch.no_grad()
    def _output(self) -> torch.Tensor:
        block = self.runner.layers[self.layer]
        return torch.cat([block(self.runner.hidden[s], **self.runner.side[s][self.layer])[0] for s in self.samples])

    def of_scales(self, names, grids, weights) -> Callable[[torch.Tensor], float]:
        """L(s) for a group: the layer's output error with its linears replaced by Q(W s) / s."""
        original = dict(zip(names, weights))
        return lambda s: self({n: g.quantize(w * s) / s for n, g, w in zip(names, grids, weights)}, original)

    def __call__(self, replacement: Dict[str, torch.Tensor], original: Dict[str, torch.Tensor]) -> float:
        self.static.update_weights(replacement)
        try:
            return float((self._output() - self.reference).pow(2).mean())
        finally:
            self.static.update_weights(original)


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n, device=x.device).long()]
