"""The quantizable groups a mixed-precision recipe chooses a precision for, and the weight grids it chooses between.

A group is one weight tensor: each decoder layer's seven linears (q, k, v, o, gate, up, down), the lm head and the
embedding. Its `pattern` is the `quant.overrides` regex that selects exactly its module, so a recipe is a list of
ordinary overrides. The embedding is not a weight-scheme choice in QnnQuantizer (it quantizes the table per tensor
at the activation bits): it is measured at 8 against 16 bits per tensor, shown in the table, and left out of recipes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

import torch

from qexp.core.errors import ConfigError
from qexp.models.shapes import static_module_path
from qexp.quant.grid import WeightGrid

# Meta linear name -> the name a researcher uses for it
PROJECTIONS = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w1": "gate", "w3": "up", "w2": "down"}
LM_HEAD, EMBEDDING = "lm_head", "embedding"


@dataclass(frozen=True)
class Group:
    name: str  # layers.3.down, lm_head, embedding
    meta_key: str  # the Meta-layout weight: layers.3.feed_forward.w2.weight
    layer: Optional[int]  # decoder layer (None: lm head, embedding)
    projection: str  # q, k, v, o, gate, up, down, lm_head, embedding
    n_weights: int

    @property
    def module_path(self) -> str:
        return "tok_embeddings" if self.projection == EMBEDDING else static_module_path(self.meta_key)

    @property
    def pattern(self) -> str:
        """The quant.overrides pattern selecting this group's module alone."""
        return re.escape(self.module_path) + ("$" if self.projection != EMBEDDING else "")

    @property
    def in_recipes(self) -> bool:
        return self.projection != EMBEDDING


def model_groups(shapes: dict) -> List[Group]:
    """Every group of a model, from its Meta weight shapes (name -> shape), in forward order."""
    groups = []
    if "tok_embeddings.weight" in shapes:
        table = "tok_embeddings.weight"
        groups.append(Group(EMBEDDING, table, None, EMBEDDING, _numel(shapes[table])))
    layers = sorted({int(k.split(".")[1]) for k in shapes if k.startswith("layers.")})
    for i in layers:
        for part, meta in (("attention", ("wq", "wk", "wv", "wo")), ("feed_forward", ("w1", "w3", "w2"))):
            for name in meta:
                key = f"layers.{i}.{part}.{name}.weight"
                if key in shapes:
                    groups.append(Group(f"layers.{i}.{PROJECTIONS[name]}", key, i, PROJECTIONS[name],
                                        _numel(shapes[key])))
    if "output.weight" in shapes:
        groups.append(Group(LM_HEAD, "output.weight", None, LM_HEAD, _numel(shapes["output.weight"])))
    return groups


def select_groups(groups: List[Group], pattern: str) -> List[Group]:
    """The groups whose name matches `pattern` (a regex, searched): `layers\\.(0|1)\\.`, `down|lm_head`, `.*`."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"sensitivity.groups {pattern!r} is not a valid regex ({exc})",
                          "give a Python regex over group names such as layers.3.down, lm_head") from None
    chosen = [g for g in groups if regex.search(g.name)]
    if not chosen:
        examples = ", ".join(g.name for g in groups[:3] + groups[-2:])
        raise ConfigError(f"sensitivity.groups {pattern!r} matches no group of this model",
                          f"group names look like: {examples}")
    return chosen


@dataclass(frozen=True)
class TensorGrid:
    """The embedding's grid: asymmetric per tensor at `bits` (QnnQuantizer's activation encoding of the table)."""

    bits: int

    def describe(self) -> str:
        return f"uint{self.bits} asym per tensor"

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        low, high = float(w.min()), float(w.max())
        scale = max(high - low, 1e-12) / (2 ** self.bits - 1)
        zero = round(-low / scale)
        return (torch.clamp(torch.round(w / scale) + zero, 0, 2 ** self.bits - 1) - zero) * scale


def grids_for(group: Group, low: WeightGrid, high: WeightGrid):
    """(low, high) grids of one group: the embedding's per-tensor pair, or the two weight grids."""
    if group.projection == EMBEDDING:
        return TensorGrid(8), TensorGrid(16)
    return low, high


def average_bits(groups: List[Group], bits: dict) -> float:
    """Average weight bits per decoder-linear weight (name -> bits; the lm head and the embedding are said apart),
    weighted by each group's weight count."""
    decoder = [g for g in groups if g.layer is not None]
    total = sum(g.n_weights for g in decoder)
    return sum(g.n_weights * bits[g.name] for g in decoder) / total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n

