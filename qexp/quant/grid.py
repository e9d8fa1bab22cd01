"""The weight grid QnnQuantizer will use for each linear layer, so algorithms search against the real target.

QnnQuantizer quantizes every linear (a 1x1 conv in the static llama) symmetrically: per output channel, or per block
of `block_size` input channels (LPBQ), with ints in [-(2^(b-1) - 1), 2^(b-1) - 1] and scale = absmax / qmax
(its PerChannel/PerBlockParamObserver; 4-bit is [-7, 7], not [-8, 7]). Per-block scales are then stored
as HTP's LPBQ encoding does (4-bit multiples of a per-channel unit, qexp/quant/lpbq.py), and searched that way.
Per-layer overrides (the 8-bit lm head of the shipped recipes) apply as in qexp/quant/recipe.py: the last matching
override pattern wins, as in QnnQuantizer.

Also here: the names that tie the Meta-layout state dict (what transforms edit) to the static llama's modules (what
QnnQuantizer annotates): `layers.3.attention.wq.weight` <-> `layers.3.attention.wq_conv`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

import torch

from qexp.core.config import NO_QUANT, BlockScaleRounding, Granularity
from qexp.models.shapes import static_module_path
from qexp.quant.lpbq import quantize_block_scales

SCALE_EPS = torch.finfo(torch.float32).eps  # the observers' eps (DEFAULT_EPS_FP32)

# The linear layers of one decoder layer, Meta names (q, k, v, o; gate, down, up).
ATTENTION = ("wq", "wk", "wv", "wo")
FEED_FORWARD = ("w1", "w2", "w3")


def layer_linears(i: int) -> List[str]:
    return ([f"layers.{i}.attention.{n}.weight" for n in ATTENTION]
            + [f"layers.{i}.feed_forward.{n}.weight" for n in FEED_FORWARD])


def override_weight_regex(pattern: str) -> str:
    """The regex an override's weight rule matches module paths with: the pattern, limited to conv modules (a module
    path also matches the non-weight ops inside it, which have no channel axis; lookahead paths end in "conv")."""
    return f"(?=.*conv$)(?:{pattern})"


def weight_layers(shapes: dict) -> list:
    """The Meta names of the quantized linear weights among `shapes` (Meta name -> shape): the decoder layers' and
    the lm head's."""
    return [key for key, shape in shapes.items()
            if len(shape) == 2 and (key.startswith("layers.") or key == "output.weight")]


def weight_bits(scheme: str) -> int:
    """Weight bits of a QNN scheme name: '16a4w' -> 4, '16a4w_block' -> 4, '8a8w' -> 8, '16a3w' -> 3."""
    match = re.fullmatch(r"(?:fp)?\d+a(\d+)w(?:_block)?", scheme)
    if not match:
        raise ValueError(f"not a quantized scheme: {scheme!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class WeightGrid:
    bits: int
    block_size: Optional[int] = None  # None: one scale per output channel
    # per-block scales as HTP stores them (LPBQ, qexp/quant/lpbq.py); per-channel scales are exact on HTP
    block_scale_rounding: BlockScaleRounding = BlockScaleRounding.nearest

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def describe(self) -> str:
        if self.bits == 2:  # QnnQuantizer's 2-bit codes are [-2, 1] (four levels), not a symmetric grid
            return "int2 [-2, 1] per channel"
        if not self.block_size:
            return f"int{self.bits} sym per channel"
        return f"int{self.bits} sym block {self.block_size} (LPBQ scales: {self.block_scale_rounding.value})"

    def _groups(self, w: torch.Tensor) -> torch.Tensor:
        out, cols = w.shape
        size = self.block_size or cols
        if cols % size:
            raise ValueError(f"block_size {size} does not divide the layer's {cols} input channels")
        return w.reshape(out, cols // size, size)

    def scales(self, w: torch.Tensor) -> torch.Tensor:
        """Scale per (output channel, block): [out, n_blocks] (n_blocks = 1 per channel)."""
        scales = (self._groups(w).abs().amax(-1) / self.qmax).clamp(min=SCALE_EPS)
        return quantize_block_scales(scales, self.block_scale_rounding) if self.block_size else scales

    def expand(self, scales: torch.Tensor, cols: int) -> torch.Tensor:
        """[out, n_blocks] scales -> [out, cols], one per weight."""
        return scales.repeat_interleave(cols // scales.shape[1], dim=1)

    def quantize(self, w: torch.Tensor, scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Fake-quantize `w` [out, in] (round half to even, as torch's fake_quantize ops)."""
        scales = self.scales(w) if scales is None else scales
        s = self.expand(scales, w.shape[1])
        return torch.clamp(torch.round(w / s), -self.qmax, self.qmax) * s


def matching_override(quant_cfg, meta_key: str):
    """The override that decides the linear `meta_key`, or None: the last matching one wins, as in QnnQuantizer
    (strategies of equal priority: the later one first)."""
    path = static_module_path(meta_key)
    return next((o for o in reversed(list(quant_cfg.overrides))
                 if re.search(override_weight_regex(o.pattern), path)), None)


def grid_for(quant_cfg, meta_key: str) -> Optional[WeightGrid]:
    """The grid QnnQuantizer will give the weight `meta_key` under `quant_cfg` (None: not quantized)."""
    if quant_cfg.scheme == NO_QUANT:
        return None
    override = matching_override(quant_cfg, meta_key)
    if override is not None:
        block = override.block_size if override.granularity == Granularity.per_block else None
        return WeightGrid(weight_bits(override.scheme), block, _rounding(quant_cfg))
    block = quant_cfg.block_size if quant_cfg.weight_granularity == Granularity.per_block else None
    return WeightGrid(weight_bits(quant_cfg.scheme), block, _rounding(quant_cfg))


def activation_bits_for(quant_cfg, meta_key: str) -> Optional[int]:
    """The bits QnnQuantizer gives the input activation of the linear `meta_key` (None: not quantized): the scheme's,
    or the deciding override's, which annotates the conv and so its input (qexp/quant/recipe.py)."""
    if quant_cfg.scheme == NO_QUANT:
        return None
    override = matching_override(quant_cfg, meta_key)
    return activation_bits((override or quant_cfg).scheme)


def activation_bits(scheme: str) -> int:
    """Activation bits of a QNN scheme name: '8a8w' -> 8, '16a4w_block' -> 16, 'fp16a8w' -> 16 (float16: the QDQ
    phase leaves such activations unquantized)."""
    match = re.match(r"(?:fp)?(\d+)a\d+w", scheme)
    if not match:
        raise ValueError(f"not a quantized scheme: {scheme!r}")
    return int(match.group(1))


def _rounding(quant_cfg) -> BlockScaleRounding:
    value = getattr(quant_cfg, "block_scale_rounding", BlockScaleRounding.nearest)
    return value if isinstance(value, BlockScaleRounding) else BlockScaleRounding(value)


def grid_tags(cfg) -> dict:
    """What the decoder's linears and the lm head were quantized to, and whether a QNN backend can run it."""
    from qexp.core.config import QDQ_ONLY_SCHEMES

    weight_grid = grid_for(cfg.quant, "layers.0.attention.wq.weight").describe()
    if str(cfg.quant.get("weight_range", "narrow")).endswith("full") and weight_grid.startswith("int4"):
        weight_grid = weight_grid.replace("int4 sym", "int4 sym [-8, 7]")  # the quant.weight_range=full ablation
    return {"weight_grid": weight_grid,
            "lm_head_grid": grid_for(cfg.quant, "output.weight").describe(),
            "deployable": str(cfg.quant.scheme not in QDQ_ONLY_SCHEMES).lower()}


def grid_bits(grid) -> float:
    """Storage bits per weight: an LPBQ block adds its 4-bit scale multiple shared by `block_size` weights
    (block 16: 4.25 bits); per-channel scales are one per row (negligible)."""
    block = getattr(grid, "block_size", None)
    return grid.bits + (4.0 / block if block else 0.0)
