"""SeqMSE: ExecuTorch's weight-scale search for the QNN flow (executorch.backends.qualcomm._passes.SeqMSE), run as
upstream's static-llama PTQ runs it (examples/qualcomm/oss_scripts/llama: one calibration sample, inside the context
manager, after that sample's first forward).

For every conv weight it tries `candidates` shrink factors of the observer's scale and keeps the one minimising the
MSE of that conv's output on the sample. Upstream leaves the result as a patched `calculate_qparams` on the observer,
which neither the observer's state dict nor qexp's observer statistics carry, so the kv / prefill graphs the HTP
backend quantizes with the same statistics would silently lose it. qexp bakes the factor into the observer's range
instead (weight observers are symmetric: scale = max|range| / qmax, so range x f gives scale x f) and restores the
observer's own method: the QDQ program and every deployed graph then read the same searched scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qexp.core.config import NO_QUANT
from qexp.core.errors import ConfigError
from qexp.transforms.base import CalibrationAlgorithm, TransformConfig, register_transform


@dataclass
class SeqMseConfig(TransformConfig):
    candidates: int = 30  # QAIRT's default for its lpbq_seqmse recipe (upstream's Llama tutorial uses 1000)


@register_transform
class SeqMse(CalibrationAlgorithm):
    name = "seq_mse"
    config_class = SeqMseConfig
    version = 2  # 2: searches against the LPBQ block scales (quant.block_scale_rounding), not the float ones

    def validate(self, cfg) -> None:
        from qexp.core.config import Granularity
        from qexp.transforms.base import refuse_two_bit_weights

        if cfg.quant.scheme == NO_QUANT:
            raise ConfigError("algorithm seq_mse searches weight scales, and quant=fp32 has none",
                              "choose a quantized scheme, e.g. quant=16a4w_block")
        refuse_two_bit_weights(cfg, self.name)
        if cfg.quant.weight_granularity == Granularity.per_tensor:
            raise ConfigError("algorithm seq_mse needs per-channel or per-block weights (ExecuTorch's search has no "
                              "per-tensor case)", "set quant.weight_granularity=per_channel or per_block")
        if self.config.candidates < 1:
            raise ConfigError(f"algorithm.seq_mse.candidates={self.config.candidates}", "use at least 1 candidate")

    def calibrate(self, prepared, static, calibration, device) -> None:
        from qexp.core.device import to_device
        from qexp.upstream.private_quantize import seq_mse_search

        sample = calibration.samples[0]
        steps = seq_mse_search(prepared, lambda: prepared(*to_device(static.inputs(sample), device)),
                               self.config.candidates)
        for observer, step in steps:
            bake_scale_factor(observer, step)


def bake_scale_factor(observer, factor: float) -> None:
    """Make a symmetric weight observer's scale `factor` x its current one, through its range."""
    with torch.no_grad():
        observer.min_val = observer.min_val * factor
        observer.max_val = observer.max_val * factor
