"""Recipes from a sensitivity table: the fewest average bits per decoder-linear weight within a perplexity budget,
or the best recipe within a bits budget.

Start from every group at the low grid and promote groups to the high grid, the most useful per extra decoder-linear
bit first (the lm head, whose bits are said apart, first if it helps). Usefulness is the mean of a group's two
isolated measurements (the loss it causes alone at low precision, the loss it removes alone at high precision), in
log perplexity. For a perplexity budget the number of promotions is found by bisection on measured perplexities of
the selection windows (one forward pass each, weights fake-quantized): the isolated measurements only order the
groups. A budget that even all-high misses is reported with the closest recipe (all-high). Both are chosen on the
selection windows, and may overfit them: report a recipe on the test windows with an ordinary run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import pandas as pd
import yaml

from qexp.sensitivity.groups import Group, average_bits


@dataclass
class Recipe:
    budget: float  # the perplexity budget (ppl / ppl_fp - 1), or the bits budget (`kind` "bits")
    promoted: List[str]  # group names at the high grid
    ppl_ratio_selection: float  # measured ppl / ppl_fp - 1 on the selection windows
    average_bits: float  # per decoder-linear weight (the lm head apart: lm_head_bits)
    met: bool
    evaluations: int = 0
    notes: List[str] = field(default_factory=list)
    kind: str = "ppl"  # "ppl": the fewest bits within a perplexity budget; "bits": the best order within a bits budget
    lm_head_bits: float = float("nan")  # the lm head's bits (not in average_bits)


def usefulness(table: pd.DataFrame) -> Dict[str, float]:
    """Per group: mean of log(1 + cost) and -log(1 + gain) over the views measured (>= 0 for a useful group)."""
    out = {}
    for row in table.itertuples():
        values = []
        if "cost" in table and not math.isnan(row.cost):
            values.append(math.log1p(row.cost))
        if "gain" in table and not math.isnan(row.gain):
            values.append(-math.log1p(row.gain))
        out[row.group] = max(sum(values) / len(values), 0.0) if values else 0.0
    return out


def _recipe(budget: float, promoted: List[str], ratio: float, met: bool, evaluations: int, candidates: List[Group],
            bits: pd.DataFrame, kind: str = "ppl", notes: Optional[List[str]] = None) -> Recipe:
    chosen = {g.name: bits.at[g.name, "bits_high" if g.name in promoted else "bits_low"] for g in candidates}
    lm_head = float(chosen["lm_head"]) if "lm_head" in chosen else float("nan")
    return Recipe(budget, promoted, ratio, average_bits(candidates, chosen), met, evaluations, notes or [], kind,
                  lm_head)


def _promotion_order(table: pd.DataFrame, groups: List[Group]):
    """(candidates, order, usefulness, bits table): the groups a recipe may promote, the most useful per extra bit of
    the decoder linears first. The lm head costs none of those bits (its storage is said apart): it comes first
    where promoting it helps at all."""
    candidates = [g for g in groups if g.in_recipes]
    bits = table.set_index("group")
    use = usefulness(table)

    def value(g: Group) -> float:
        if g.layer is None:
            return math.inf if use[g.name] > 0 else -math.inf
        return use[g.name] / ((bits.at[g.name, "bits_high"] - bits.at[g.name, "bits_low"]) * g.n_weights)

    return candidates, sorted(candidates, key=value, reverse=True), use, bits


def within_bits(table: pd.DataFrame, groups: List[Group], max_bits: float,
                measure: Callable[[List[str]], float]) -> Recipe:
    """The recipe for a bits budget (per decoder-linear weight): promote in order while the average stays within it
    (skipping a group that would pass it, for a smaller one later; the lm head costs no decoder bits), then measure
    it once."""
    candidates, order, _, bits = _promotion_order(table, groups)
    promoted: List[str] = []
    for g in order:
        if _recipe(0, promoted + [g.name], 0, True, 0, candidates, bits).average_bits <= max_bits:
            promoted.append(g.name)
    recipe = _recipe(max_bits, promoted, measure(promoted), True, 1, candidates, bits, kind="bits")
    if recipe.average_bits > max_bits:
        recipe.met = False
        recipe.notes.append(f"every group low is already {recipe.average_bits:.3f} bits > {max_bits}")
    return recipe


def synthesize(table: pd.DataFrame, groups: List[Group], budget: float,
               measure: Callable[[List[str]], float]) -> Recipe:
    """The recipe for one perplexity budget. `measure(promoted)` -> ppl / ppl_fp - 1 on the selection windows."""
    candidates, order, _, bits = _promotion_order(table, groups)
    ratio_low = measure([])
    if ratio_low <= budget:
        return _recipe(budget, [], ratio_low, True, 1, candidates, bits)
    all_names = [g.name for g in candidates]
    ratio_high = measure(all_names)
    if ratio_high > budget:
        return _recipe(budget, all_names, ratio_high, False, 2, candidates, bits, notes=[
            f"no recipe meets +{budget:.1%}: every group at the high grid gives {ratio_high:+.2%}"])
    # the fewest promotions in this order that meet the budget, by bisection on measured ratios (promoting more
    # groups is taken to help: the measured ends bracket the answer)
    low_k, high_k, evaluations = 0, len(order), 2
    ratios = {high_k: ratio_high}
    while high_k - low_k > 1:
        mid = (low_k + high_k) // 2
        ratios[mid] = measure([g.name for g in order[:mid]])
        evaluations += 1
        low_k, high_k = (low_k, mid) if ratios[mid] <= budget else (mid, high_k)
    promoted = [g.name for g in order[:high_k]]
    return _recipe(budget, promoted, ratios[high_k], True, evaluations, candidates, bits)


def recipe_overrides(groups: List[Group], promoted: List[str], high_scheme: str, note: str) -> List[dict]:
    """The promoted groups as quant.overrides: one per projection kind, its layers as an alternation."""
    by_kind: Dict[str, List[Group]] = {}
    for g in groups:
        if g.name in promoted:
            by_kind.setdefault(g.projection, []).append(g)
    overrides = []
    for kind, members in by_kind.items():
        if members[0].layer is None:
            pattern = members[0].pattern
        else:
            suffix = re.escape(members[0].module_path.split(".", 2)[2])
            layers = "|".join(str(g.layer) for g in sorted(members, key=lambda g: g.layer))
            pattern = rf"layers\.({layers})\.{suffix}$"
        overrides.append({"pattern": pattern, "scheme": high_scheme, "granularity": "per_channel",
                          "note": f"{note}: {kind} of {len(members)} layer(s)" if members[0].layer is not None
                          else f"{note}: {kind}"})
    return overrides


def recipe_yaml(quant, recipe: Recipe, overrides: List[dict], name: str, header: str) -> str:
    """A conf/quant-style YAML: the low precision as the scheme, the promotions as overrides."""
    body = {"name": name, "scheme": str(quant.scheme), "weight_granularity": _value(quant.weight_granularity),
            "block_size": int(quant.block_size), "custom_annotations": list(quant.custom_annotations),
            "overrides": overrides}
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(body, sort_keys=False, width=120)


def _value(x):
    return getattr(x, "value", x)
