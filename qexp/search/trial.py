"""One search trial: the recipe of a point of the search space, measured on the selection windows.

Like the sensitivity analysis' recipe measurements (qexp/sensitivity/run.py), the weights are fake-quantized in the
float static llama and the activations stay float: one forward pass over the selection windows per trial, no
export. The analysis, the windows, the static model and the float pass are built once per process and config
(`evaluator_for`), so the trials of a sweep cost a forward pass each; a point already measured is not measured
again. The recipes on the front are then checked by ordinary QDQ runs on the test windows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List

import numpy as np
from omegaconf import OmegaConf

from qexp.cache import stable_hash
from qexp.core.search_config import SEARCH_KINDS
from qexp.sensitivity.groups import grids_for
from qexp.sensitivity.replay import perplexity

log = logging.getLogger("qexp")

LM_HEAD = "lm_head"


@dataclass
class TrialResult:
    promoted: List[str]
    ppl: float  # on the selection windows
    ppl_fp: float
    ppl_ratio: float  # ppl / ppl_fp - 1
    ci_low: float  # 95% paired interval of ppl_ratio (qexp/eval/uncertainty.py)
    ci_high: float
    bits: float  # per decoder-linear weight
    lm_head_bits: float
    weights_mb: float  # the decoder linears as the HTP program stores them (codes and scales)
    lm_head_mb: float
    speed: object  # a qexp.speed SpeedEstimate of the decode step
    overrides: List[dict]

    def objective(self, name: str) -> float:
        return {"ppl": self.ppl_ratio, "bits": self.bits, "decode_tok_s": self.speed.decode_tok_s}[name]

    def metrics(self) -> Dict[str, float]:
        return {"ppl_selection": self.ppl, "ppl_fp_selection": self.ppl_fp, "ppl_vs_fp_selection": self.ppl_ratio,
                "ppl_vs_fp_selection_ci_low": self.ci_low, "ppl_vs_fp_selection_ci_high": self.ci_high,
                "bits": self.bits, "lm_head_bits": self.lm_head_bits, "promoted": len(self.promoted),
                "weights_decoder_mb": self.weights_mb, "weights_lm_head_mb": self.lm_head_mb,
                **self.speed.metrics()}


def kind_order(table, groups) -> Dict[str, List[str]]:
    """Per projection kind, its layers' group names, the most useful at the high precision first (the usefulness
    of qexp/sensitivity/synthesis.py; ties keep the forward order, as the greedy synthesis does)."""
    from qexp.sensitivity.synthesis import usefulness

    use = usefulness(table)
    order: Dict[str, List[str]] = {}
    for g in groups:
        if g.in_recipes and g.layer is not None:
            order.setdefault(g.projection, []).append(g.name)
    return {kind: sorted(names, key=lambda n: use[n], reverse=True) for kind, names in order.items()}


class Evaluator:
    """The analysis and the float pass of one config, and the measurement of any recipe on its search windows."""

    def __init__(self, cfg):
        from qexp.sensitivity.analysis import analyse, selection_windows
        from qexp.sensitivity.measure import GroupWeights
        from qexp.sensitivity.replay import LayerReplay
        from qexp.speed import model_shapes
        from qexp.models.static_llama import StaticLlama

        self.analysis = a = analyse(cfg)
        self.windows = selection_windows(a.state, cfg, cfg.search.selection, "search.selection")
        static = StaticLlama.private_copy(a.model, self.windows.seq_len, cfg.model)  # weights edited in place
        self.replay = LayerReplay(static, self.windows)
        self.weights = GroupWeights(static.module, a.groups, a.program)
        self.fp_ll = self.replay.loglik(0)
        self.order = kind_order(a.table, a.groups)
        self.candidates = [g for g in a.groups if g.in_recipes]
        self.shapes = model_shapes(cfg.model)
        self._measured: Dict[tuple, TrialResult] = {}

    def promoted(self, promote) -> List[str]:
        names = []
        for kind in SEARCH_KINDS:
            names += self.order.get(kind, [])[: int(promote.get(kind, 0))]
        if int(promote.get(LM_HEAD, 0)) and any(g.name == LM_HEAD for g in self.candidates):
            names.append(LM_HEAD)
        return names

    def point_of(self, promoted: List[str]) -> Dict[str, int]:
        """The search-space point of a set of promoted groups (per kind, how many of its layers)."""
        chosen = set(promoted)
        point = {kind: sum(n in chosen for n in self.order.get(kind, [])) for kind in SEARCH_KINDS}
        point[LM_HEAD] = int(LM_HEAD in chosen)
        return point

    def evaluate(self, cfg) -> TrialResult:
        promoted = self.promoted(cfg.search.promote)
        key = tuple(sorted(promoted))
        if key not in self._measured:
            self._measured[key] = self._measure(cfg, promoted)
        return self._measured[key]

    def _measure(self, cfg, promoted: List[str]) -> TrialResult:
        from qexp.eval.uncertainty import ppl_ratio_interval
        from qexp.sensitivity.synthesis import recipe_overrides
        from qexp.speed import estimate_config
        from qexp.speed.bytes import weight_size

        a, chosen = self.analysis, set(promoted)

        def grid(g):  # the embedding is not a recipe's choice: at the 16-bit activations' per-tensor grid
            low, high = grids_for(g, a.low, a.high)
            return high if g.name in chosen or not g.in_recipes else low

        self.weights.put_all(grid)
        ll = self.replay.loglik(0)
        overrides = recipe_overrides(a.groups, promoted, cfg.sensitivity.high, "mixed-precision search")
        quant = OmegaConf.merge(cfg.quant, {"overrides": overrides})  # typed: each override a QuantOverride
        speed, _ = estimate_config(self.shapes, quant, cfg.search.soc, int(cfg.export.max_context_len), None, 1)
        size = weight_size(self.shapes, quant)  # what every run of the recipe logs as its size
        interval = ppl_ratio_interval(ll, self.fp_ll)
        ppl, ppl_fp = perplexity(ll), perplexity(self.fp_ll)
        return TrialResult(promoted, ppl, ppl_fp, ppl / ppl_fp - 1, interval.get("ci_low", np.nan),
                           interval.get("ci_high", np.nan), size["weight_bits_decoder"], size["weight_bits_lm_head"],
                           size["weights_htp_decoder_mb"], size["weights_htp_lm_head_mb"], speed, overrides)


_EVALUATOR: Dict[str, Evaluator] = {}  # one at a time: a model's static copy and kept activations are large


def evaluator_key(cfg) -> str:
    """What an Evaluator depends on: the config without the trial's point, its objectives and its tracking."""
    container = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                 for k in cfg if k not in ("hydra", "tracking", "verbose")}
    search = container.get("search") or {}
    for key in ("promote", "objectives", "recipe_dir", "seed_bits"):
        search.pop(key, None)
    return stable_hash(container)


def evaluator_for(cfg) -> Evaluator:
    key = evaluator_key(cfg)
    if key not in _EVALUATOR:
        _EVALUATOR.clear()
        log.info("search: preparing the model, the sensitivity table and the float pass (once per sweep)")
        _EVALUATOR[key] = Evaluator(cfg)
    return _EVALUATOR[key]
