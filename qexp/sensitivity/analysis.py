"""One sensitivity analysis: validate, build the selection windows, measure (qexp/sensitivity/measure.py) once per
cache key, and return the table.

The table has one row per group: its isolated perplexity deltas in each view with their paired intervals, the
output SQNR of its module at each grid and the FIT proxy. Rank correlations say how far the cheap rankings (SQNR,
FIT) agree with the measured deltas.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
import pandas as pd

from qexp.cache import stable_hash
from qexp.core.config import NO_QUANT, BlockScaleRounding, Granularity
from qexp.core.sensitivity_config import SENSITIVITY_VIEWS
from qexp.core.errors import ConfigError
from qexp.quant.grid import grid_bits
from qexp.sensitivity.groups import Group, grids_for, model_groups, select_groups
from qexp.sensitivity.program import analysed_model, program_weights, start_model, validate_low_weights
from qexp.quant.grid import WeightGrid, weight_bits

log = logging.getLogger("qexp")

ANALYSIS_VERSION = 3  # bump when the same inputs would give another table


@dataclass
class Analysis:
    table: pd.DataFrame
    summary: Dict[str, float]
    groups: List[Group]
    low: WeightGrid
    high: WeightGrid
    selection: object  # Windows
    model: object  # the LoadedModel measured (transforms applied)
    cache_hit: bool = False
    tags: Dict[str, str] = field(default_factory=dict)
    state: object = None  # the RunState prepared through the transforms (its corpus, tokenizer, calibration)
    program: object = None  # ProgramWeights with low_weights=algorithms (qexp/sensitivity/program.py), else None


def low_grid(quant) -> WeightGrid:
    block = quant.block_size if quant.weight_granularity == Granularity.per_block else None
    rounding = BlockScaleRounding(getattr(quant.block_scale_rounding, "value", quant.block_scale_rounding))
    return WeightGrid(weight_bits(quant.scheme), block, rounding)


def high_grid(scheme: str) -> WeightGrid:
    try:
        return WeightGrid(weight_bits(scheme))
    except ValueError:
        raise ConfigError(f"sensitivity.high={scheme!r} is not a quantized scheme", "use e.g. 16a8w") from None


def validate_analysis(cfg) -> None:
    """One line for a config the analysis cannot use, before any model is loaded."""
    from qexp.models.shapes import linear_shapes
    from qexp.pipeline import validate

    if cfg.quant.scheme == NO_QUANT:
        raise ConfigError("quant=fp32: a sensitivity analysis needs a low precision to measure",
                          "choose the low precision with quant=, e.g. quant=16a4w or quant=16a4w_block")
    if low_grid(cfg.quant).bits == 2:
        raise ConfigError(f"quant={cfg.quant.scheme}: the analysis fake-quantizes weights on symmetric grids, and "
                          "2-bit weights are the asymmetric codes [-2, 1]",
                          "analyse at 4 bits (quant=16a4w or quant=16a4w_block)")
    s = cfg.sensitivity
    low, high = low_grid(cfg.quant), high_grid(s.high)
    if grid_bits(high) <= grid_bits(low):
        raise ConfigError(f"sensitivity.high={s.high} is not more precise than quant={cfg.quant.name} "
                          f"({high.describe()} vs {low.describe()})", "use a higher sensitivity.high (16a8w)")
    unknown = [v for v in s.views if v not in SENSITIVITY_VIEWS]
    if unknown or not s.views:
        raise ConfigError(f"sensitivity.views={list(s.views)}",
                          f"choose one or both of: {', '.join(SENSITIVITY_VIEWS)}")
    if s.selection.limit < 2 or s.selection.seq_len < 16:
        raise ConfigError(f"sensitivity.selection={dict(s.selection)}: too little selection data",
                          "use selection.limit >= 2 windows of seq_len >= 16 tokens")
    bad = [b for b in s.budgets if not 0 < b < 10]
    if bad:
        raise ConfigError(f"sensitivity.budgets {bad}", "give perplexity budgets as fractions, e.g. [0.03, 0.05]")
    bad = [b for b in s.bit_budgets if not grid_bits(low) <= b <= grid_bits(high)]
    if bad:
        raise ConfigError(f"sensitivity.bit_budgets {bad} outside [{grid_bits(low):g}, {grid_bits(high):g}]",
                          "give average bits between the low and the high precision's")
    shapes = linear_shapes(cfg.model)
    if shapes:
        select_groups(model_groups(shapes), s.groups)
    validate_low_weights(cfg, validate(cfg).transforms)


def selection_windows(state, cfg, selection=None, key: str = "sensitivity.selection"):
    """Windows of the calibration half's second half (by characters), disjoint from the calibration samples;
    `selection` (a SelectionConfig, the analysis' by default) says how many and how long, `key` where it is set."""
    from qexp.data.calibration import check_disjoint
    from qexp.data.windows import make_windows

    selection = selection or cfg.sensitivity.selection
    text = state.corpus.joined("calibration")
    windows = make_windows(text[len(text) // 2 :], state.model.tokenizer, selection.seq_len, selection.limit,
                           state.model.add_bos)
    if windows.n_windows < selection.limit:
        raise ConfigError(f"the calibration half holds {windows.n_windows} selection windows of {selection.seq_len} "
                          f"tokens, not {selection.limit}", f"lower {key}.limit or {key}.seq_len")
    if state.calibration is not None:
        check_disjoint(state.calibration, windows)
    return windows


def analyse(cfg, progress=log.info) -> Analysis:
    """The whole analysis of `cfg` (validated): the run's stages up to its transforms, then the measurements."""
    from qexp.core.device import device_key, move
    from qexp.models.static_llama import StaticLlama
    from qexp.pipeline import prepare
    from qexp.core.provenance import library_versions

    state = prepare(cfg, through="transform")
    s = cfg.sensitivity
    selection = selection_windows(state, cfg)
    model, program = state.deploy_model, None
    groups = select_groups(model_groups({k: tuple(v.shape) for k, v in model.state_dict.items()}), s.groups)
    low, high = low_grid(cfg.quant), high_grid(s.high)
    if s.low_weights == "algorithms":
        start = start_model(state)
        program = program_weights(start, state.deploy_model, state.deploy_static, groups, cfg.quant, low)
        model = analysed_model(start, state.deploy_model, groups)
    deployed = state.deploy_static
    key = {"model": model.fingerprint, "r3": deployed.r3, "masked_softmax": deployed.masked_softmax,
           "low": low.describe(), "high": high.describe(), "groups": [g.name for g in groups],
           "views": sorted(s.views), "selection": selection.sha256, "versions": library_versions(),
           "version": ANALYSIS_VERSION}
    if program is not None:  # absent otherwise: the tables cached before the setting existed stay valid
        key["low_weights"] = program.fingerprint
    key = stable_hash(key)

    key = stable_hash({"analysis": key, **device_key(state.device)}) if state.device.type != "cpu" else key

    def build(tmp):
        static = StaticLlama.private_copy(model, selection.seq_len, cfg.model)  # weights are edited in place
        move(static.module, state.device)  # measured on the run's device (the static llama is the analysis' own)
        table, summary = measure_table(static, selection, groups, low, high, list(s.views), progress, program)
        table.to_csv(tmp / "sensitivity.csv", index=False)
        return summary

    entry, hit = state.cache.get_or_build("sensitivity", key, build)
    table = pd.read_csv(entry / "sensitivity.csv")
    summary = state.cache.meta("sensitivity", key)
    tags = {"model_sha256": state.model.fingerprint, "model_sha256_transformed": model.fingerprint,
            "text_source": state.corpus.source, "selection_windows_sha256": selection.sha256,
            "sensitivity_cache_hit": str(hit).lower(), "sensitivity_low": low.describe(),
            "sensitivity_high": high.describe(), "sensitivity_low_weights": s.low_weights}
    return Analysis(table, summary, groups, low, high, selection, model, hit, tags, state, program)


def measure_table(static, selection, groups, low, high, views, progress,
                  program=None) -> tuple[pd.DataFrame, dict]:
    from qexp.sensitivity.measure import GroupWeights, float_pass, isolated_deltas
    from qexp.sensitivity.replay import LayerReplay, perplexity

    started = time.time()
    replay = LayerReplay(static, selection)
    weights = GroupWeights(static.module, groups, program)
    fp_ll, stats = float_pass(replay, weights, groups, low, high)
    rows = {g.name: {"group": g.name, "layer": g.layer, "projection": g.projection, "n_weights": g.n_weights,
                     "in_recipes": g.in_recipes, "bits_low": grid_bits(grids_for(g, low, high)[0]),
                     "bits_high": grid_bits(grids_for(g, low, high)[1]), **stats[g.name]} for g in groups}
    summary = {"selection_windows": selection.n_windows, "selection_window_len": selection.seq_len,
               "selection_predicted_tokens": selection.n_predicted, "ppl_fp_selection": perplexity(fp_ll)}
    for view in views:
        base, deltas = isolated_deltas(replay, weights, groups, low, high, view, progress)
        summary[f"ppl_all_{'high' if view == 'cost' else 'low'}_selection"] = perplexity(base)
        for group, d in zip(groups, deltas):
            rows[group.name].update({view: d["delta"], f"{view}_ci_low": d["ci_low"], f"{view}_ci_high": d["ci_high"]})
    weights.put_all(lambda g: None)
    summary["analysis_s"] = round(time.time() - started, 1)
    table = pd.DataFrame(list(rows.values()))
    summary.update(rank_correlations(table))
    return table, summary


def rank_correlations(table: pd.DataFrame) -> Dict[str, float]:
    """Spearman correlations of the measured deltas with the cheap rankings (higher = both say more sensitive)."""
    from scipy.stats import spearmanr

    out = {}
    finite = table.replace([np.inf, -np.inf], np.nan)
    for view, sign in (("cost", 1.0), ("gain", -1.0)):
        if view not in finite:
            continue
        measured = sign * finite[view]
        proxies = (("sqnr", -finite["sqnr_low_db"]), ("fisher", finite["fisher_low"] - finite["fisher_high"]))
        for proxy, values in proxies:
            ok = measured.notna() & values.notna()
            if ok.sum() >= 3:
                out[f"spearman_{view}_vs_{proxy}"] = float(spearmanr(measured[ok], values[ok]).statistic)
    if "cost" in finite and "gain" in finite:
        out["spearman_cost_vs_gain"] = float(spearmanr(finite["cost"], -finite["gain"]).statistic)
    return out
