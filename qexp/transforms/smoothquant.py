"""SmoothQuant (Xiao et al. 2023, arXiv:2211.10438): migrate activation outliers into the weights.

For the linears that read a norm's output (q/k/v after the attention norm, gate/up after the FFN norm), each input
channel j gets s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) (the paper's Eq. 4; max over calibration tokens and over
the rows of all linears sharing the input); X is divided by s (folded into the norm's weight) and W's columns are
multiplied by s, so the float model keeps its function. It helps 8-bit activations: the smoothed linears must read
8-bit inputs, by the scheme (8a8w, 8a4w) or by an override on them (the paper's W8A8 linears beside 16-bit norms and
residual adds; on SmolLM2 it recovers two thirds of that loss at alpha 0.8:
docs/research/2026-11-27-smoothquant.md). With 16-bit inputs the activation grid is not the bottleneck and qexp
refuses it (see `validate`).

Written here (~20 lines of math): torchao's SmoothQuant is per linear (q and k would need different scales for one
norm), llm-compressor's is function-breaking on Gemma 3.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qexp.core.config import NO_QUANT
from qexp.core.errors import ConfigError
from qexp.transforms.base import ModelTransform, TransformConfig, register_transform
from qexp.transforms.capture import LayerByLayer


@dataclass
class SmoothQuantConfig(TransformConfig):
    alpha: float = 0.5  # migration strength: 0 keeps the activations, 1 moves all of their range into the weights


def smoothing_scales(x_absmax: torch.Tensor, weights, alpha: float) -> torch.Tensor:
    """The paper's s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (clamped away from 0, as the reference code)."""
    w_absmax = torch.cat(weights).abs().amax(0).clamp(min=1e-5)
    return (x_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


# Each norm whose output it smooths, the linears reading that output (Meta names within a layer) and the captured
# input they share (qexp/transforms/capture.py).
SMOOTHED = (("attention_norm", ("attention.wq", "attention.wk", "attention.wv"), "attn_in"),
            ("ffn_norm", ("feed_forward.w1", "feed_forward.w3"), "ffn_in"))
SMOOTHED_LINEARS = tuple(name for _, names, _ in SMOOTHED for name in names)


@register_transform
class SmoothQuant(ModelTransform):
    name = "smoothquant"
    config_class = SmoothQuantConfig
    needs_calibration = True

    def validate(self, cfg) -> None:
        from qexp.quant.grid import activation_bits_for

        scheme = cfg.quant.scheme
        # The linears it smooths must read 8-bit activations: the scheme's, or an override's on those linears (the
        # paper's setting: 8-bit GEMM inputs beside higher-precision norms and residual adds). Checked over layer
        # indices up to 256, so a layer-range override (layers\.[0-3]\.) counts.
        smoothed = [f"layers.{i}.{name}.weight" for i in range(256) for name in SMOOTHED_LINEARS]
        if scheme == NO_QUANT or all(activation_bits_for(cfg.quant, key) != 8 for key in smoothed):
            raise ConfigError(f"algorithm smoothquant smooths 8-bit activations; quant={scheme} gives the linears it "
                              f"smooths (q/k/v, gate/up) {'none' if scheme == 'fp32' else '16-bit ones'}",
                              "use it with quant=8a8w or quant=8a4w, or an 8-bit-activation override on those "
                              "linears (quant.overrides)")
        if not 0 <= self.config.alpha <= 1:
            raise ConfigError(f"algorithm.smoothquant.alpha={self.config.alpha}", "use 0 <= alpha <= 1")

    def apply(self, model, context):
        state = dict(model.state_dict)
        from qexp.models.static_llama import StaticLlama

        # the float function is unchanged by smoothing, so every layer's inputs come from the float model
        static = StaticLlama.for_model_config(model, context.cfg.export.max_context_len, context.cfg.model)
        runner = LayerByLayer(static, context.calibration.samples, context.device)
        for i in range(model.params["n_layers"]):
            x = runner.run(i, inputs=[input_name for _, _, input_name in SMOOTHED])
            for norm, linears, input_name in SMOOTHED:
                norm, names = f"layers.{i}.{norm}.weight", [f"layers.{i}.{n}.weight" for n in linears]
                x_absmax = x[input_name].abs().amax(0).cpu()  # the captured inputs are on the run's device
                s = smoothing_scales(x_absmax, [state[n] for n in names], self.config.alpha)
                state[norm] = state[norm] / s
                for n in names:
                    state[n] = state[n] * s
        return dataclasses.replace(model, state_dict=state)
