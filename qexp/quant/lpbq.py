"""LPBQ block scales as HTP stores them, modelled before convert so the QDQ program computes what HTP runs.

QNN has no float per-block scales. ExecuTorch's lowering (`NodeVisitor.make_qnn_per_block_config`,
backends/qualcomm/builders/node_visitor.py) turns the per-block scales s_b of each output channel into
LPBQ ("low-power blockwise quantization", BLOCKWISE_EXPANSION): one float per channel m = max_b(s_b) / 16 and a
4-bit integer per block q_b = clamp(round(s_b / m), 1, 16), so HTP computes with the block scale q_b * m. It keeps
the integer weights convert_pt2e rounded with the float s_b. A block whose scale is 2.4 m thus runs at 2 m on the
device: its weights shrink by 17%, while the QDQ program (and every algorithm that searched against it) used 2.4 m.

qexp quantizes the block scales the same way in the weight observers' ranges, before convert. The integer weights
are then rounded against the scales HTP really uses, the QDQ program computes what the device runs, and the
lowering's re-quantization is the identity (round(q_b m / m) = q_b). `rounding`:
  - `nearest`: q_b as the lowering picks it (the default; what AIMET's LPBQ does too);
  - `up`: the smallest q_b with q_b m >= s_b, so no weight is clipped, at a coarser grid;
  - `float`: keep the float block scales (qexp before this module and upstream's QDQ program): the CPU phase then
    does not compute what HTP runs.
"""

from __future__ import annotations

import torch

from qexp.core.config import BlockScaleRounding

SCALE_BITS = 4  # bitwidth_of_scale in ExecuTorch's make_qnn_per_block_config ("TODO: expand when QNN supports more")
SCALE_STEPS = 2 ** SCALE_BITS


def quantize_block_scales(scales: torch.Tensor, rounding: BlockScaleRounding) -> torch.Tensor:
    """Per-block scales [out, n_blocks, ...] -> the scales HTP's LPBQ encoding represents (same shape)."""
    if rounding == BlockScaleRounding.float:
        return scales
    flat = scales.reshape(scales.shape[0], -1)
    unit = flat.amax(dim=-1, keepdim=True) / SCALE_STEPS
    return (scale_steps(flat / unit, rounding) * unit).reshape(scales.shape)


def scale_steps(ratio: torch.Tensor, rounding: BlockScaleRounding) -> torch.Tensor:
    """Block scale / the row's unit -> the 4-bit step count (1..16) the LPBQ encoding stores."""
    # `up`: a ratio that is an integer up to float error must stay that integer (idempotence on quantized scales)
    steps = torch.round(ratio) if rounding == BlockScaleRounding.nearest else torch.ceil(ratio - 1e-4)
    return torch.clamp(steps, 1, SCALE_STEPS)


def is_block_observer(observer) -> bool:
    from executorch.backends.qualcomm.quantizer.observers.per_block_param_observer import PerBlockParamObserver

    return isinstance(observer, PerBlockParamObserver)


def quantize_observer_scales(observers, rounding: BlockScaleRounding) -> int:
    """Set each per-block weight observer's symmetric range so its scale is the LPBQ-quantized one; returns how many
    observers were changed. Ranges are what the observers' statistics (the QDQ cache entry) hold, so the QDQ program
    and the deploy graphs built from the same statistics get the same scales."""
    changed = 0
    if rounding == BlockScaleRounding.float:
        return changed
    with torch.no_grad():
        for observer in observers:
            if not is_block_observer(observer) or not hasattr(observer, "min_val"):
                continue
            scale, _ = observer.calculate_qparams()
            target = quantize_block_scales(scale.reshape(observer.min_val.shape), rounding)
            # the observer's symmetric scale is max(|min|, max) / ((quant_max - quant_min) / 2)
            half_range = (observer.quant_max - observer.quant_min) / 2
            bound = (target * half_range).to(observer.min_val.dtype)
            observer.min_val, observer.max_val = -bound, bound.clone()
            changed += 1
    return changed
