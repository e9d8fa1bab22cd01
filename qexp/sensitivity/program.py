"""The low precision as the run's algorithms deploy it: `sensitivity.low_weights=algorithms`.

By default (`rtn`) a group's low-precision weights are the transformed model's rounded to nearest on the low grid.
After weight-rounding algorithms that is not what deploys: GPTQ's integers compensate one another's error, and
weight clipping's scales are not absmax / qmax, so an analysis of the stacked program's float weights measures a
program nobody runs (GPTQ's weights are already on the 4-bit grid: "promoting" them to 8 bits changes nothing).

With `algorithms` the run's algorithm list splits in two: the start (everything before its trailing weight-rounding
algorithms, `ModelTransform.rounds_weights`: rotation, SmoothQuant, AWQ's scales) and the rounding tail (weight
clipping, GPTQ). The analysis measures the start model; a group at the low grid takes the tail's weights on their
exact scales (the integers the QDQ program gets), at the high grid the start weights rounded to nearest (what the
tail at 8 bits comes close to). Left out: GPTQ compensates each layer for the low-precision error of the layers
before it; a promoted group changes that error, which a recipe's own run re-does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from qexp.core.errors import ConfigError
from qexp.quant.lpbq import quantize_block_scales
from qexp.sensitivity.groups import Group
from qexp.quant.grid import SCALE_EPS, WeightGrid, grid_for, weight_layers


@dataclass
class ProgramWeights:
    """Group name -> its weights [out, in] on `grid` as the algorithms deploy them."""

    grid: WeightGrid
    weights: Dict[str, torch.Tensor]
    fingerprint: str  # the transformed model's: part of the analysis' cache key


def split_algorithms(transforms: list) -> Tuple[list, list]:
    """(start, rounding tail) of the model transforms in order (the calibration-time algorithms, SeqMSE, left out)."""
    model = [t for t in transforms if t.acts_on == "model"]
    n = len(model)
    while n and model[n - 1].rounds_weights:
        n -= 1
    return model[:n], model[n:]


def validate_low_weights(cfg, transforms: list) -> None:
    """`transforms`: the run's algorithms (pipeline.validate's RunPlan)."""
    from qexp.core.sensitivity_config import LOW_WEIGHTS

    mode = cfg.sensitivity.low_weights
    if mode not in LOW_WEIGHTS:
        raise ConfigError(f"sensitivity.low_weights={mode!r}", f"choose one of: {', '.join(LOW_WEIGHTS)}")
    if mode == "algorithms":
        _, tail = split_algorithms(transforms)
        if not tail:
            names = ",".join(t.name for t in transforms)
            raise ConfigError(f"sensitivity.low_weights=algorithms: algorithm=[{names}] does not end with a weight-"
                              "rounding algorithm (weight_clip, gptq), so its low weights are round-to-nearest's",
                              "end algorithm=[...] with weight_clip and/or gptq, or use sensitivity.low_weights=rtn")


def recipe_tag(cfg) -> str:
    """What a recipe's name says of low_weights=algorithms: the rounding algorithms ("_weight_clip_gptq"), so such a
    recipe never takes a round-to-nearest recipe's name; "" for rtn."""
    from omegaconf import OmegaConf

    from qexp.pipeline import algorithms

    if OmegaConf.select(cfg, "sensitivity.low_weights", default="rtn") != "algorithms":
        return ""
    return "".join(f"_{t.name}" for t in split_algorithms(algorithms(cfg))[1])


def start_model(state):
    """The run's model through the algorithms before the rounding tail (cached where they are)."""
    from qexp.stages import apply_algorithms

    start, _ = split_algorithms(state.transforms)
    return apply_algorithms(state, start)[0]


def _linears(model) -> List[str]:
    """The Meta names of the model's quantized linear weights (what the rounding algorithms may change)."""
    return weight_layers({k: tuple(v.shape) for k, v in model.state_dict.items()})


def analysed_model(start, program, groups: List[Group]):
    """The start model with the deployed weights of the linears the analysis leaves out (`sensitivity.groups`): they
    stay as the stack left them, as in an rtn analysis."""
    chosen = {g.meta_key for g in groups}
    others = {k: program.state_dict[k] for k in _linears(program) if k not in chosen}
    return dataclasses.replace(start, state_dict={**start.state_dict, **others}) if others else start


def program_weights(start, program, static, groups: List[Group], quant_cfg, low: WeightGrid) -> ProgramWeights:
    """The tail's weights of every group the run quantized on the low grid, in the static module's row order."""
    keys = set(_linears(program))
    moved = [k for k, v in program.state_dict.items()
             if k not in keys and not torch.equal(v, start.state_dict.get(k, v.new_empty(0)))]
    if moved:  # a rounding algorithm must leave every other tensor alone, or the start model is not its input
        raise RuntimeError(f"the weight-rounding algorithms changed {moved[0]} (and {len(moved) - 1} more)")
    weights = {}
    for g in groups:
        if not g.in_recipes or grid_for(quant_cfg, g.meta_key) != low:
            continue
        _, w = static.static_layout(g.meta_key, program.state_dict[g.meta_key])
        w = w.reshape(w.shape[0], -1).float()
        scales = None
        if g.meta_key in program.weight_ranges:
            _, ranges = static.static_layout(g.meta_key, program.weight_ranges[g.meta_key])
            scales = (ranges.reshape(w.shape[0], -1).float() / low.qmax).clamp(min=SCALE_EPS)
            if low.block_size:  # as the quantize stage re-encodes them (the identity for GPTQ's LPBQ scales)
                scales = quantize_block_scales(scales, low.block_scale_rounding)
        weights[g.name] = low.quantize(w, scales)
    return ProgramWeights(low, weights, program.fingerprint)
