"""The search space of `python -m qexp.search` (hydra.sweeper.custom_search_space in conf/search.yaml).

A point is, per projection kind (q, k, v, o, gate, up, down), how many of its layers are at the high precision, the
most useful first by the sensitivity table (qexp/search/trial.py: `kind_order`), and whether the lm head is. Eight
integers instead of one bit per group: NSGA-II's budget of trials goes to how much of each kind to promote, the
decision the per-group table cannot make by itself (the groups' isolated deltas do not add up), while the table
decides which layers. Every greedy recipe of qexp/sensitivity/synthesis.py is such a point (within a kind its order
is the same), so the greedy recipes at `search.seed_bits` and the uniform scheme (lm head high) are the first trials.
"""

from __future__ import annotations

import logging
import warnings
from typing import Dict, List

from qexp.core.search_config import SEARCH_KINDS

log = logging.getLogger("qexp")

LM_HEAD = "lm_head"
PARAM = "search.promote.{}"


def define(cfg, trial) -> None:
    """Suggest one point; on the first trial also enqueue the seed trials (they follow it)."""
    from qexp.speed import model_shapes

    n_layers = model_shapes(cfg.model).n_layers
    for kind in SEARCH_KINDS:
        trial.suggest_int(PARAM.format(kind), 0, n_layers)
    trial.suggest_int(PARAM.format(LM_HEAD), 0, 1)
    if trial.number == 0:
        from optuna.exceptions import ExperimentalWarning

        with warnings.catch_warnings():  # optuna 2.x marks enqueue_trial experimental (stable since 3.0)
            warnings.simplefilter("ignore", category=ExperimentalWarning)
            for point in seed_points(cfg):
                trial.study.enqueue_trial({PARAM.format(k): v for k, v in point.items()})


def seed_points(cfg) -> List[Dict[str, int]]:
    """The uniform scheme with its lm head high, then the greedy recipe at each of `search.seed_bits`."""
    from qexp.search.trial import evaluator_for
    from qexp.sensitivity.synthesis import within_bits

    evaluator = evaluator_for(cfg)
    points = [{**{k: 0 for k in SEARCH_KINDS}, LM_HEAD: 1}]
    for bits in cfg.search.seed_bits:
        recipe = within_bits(evaluator.analysis.table, evaluator.analysis.groups, float(bits), lambda p: float("nan"))
        points.append(evaluator.point_of(recipe.promoted))
    log.info("search: %d seed trials (uniform with the lm head high; greedy recipes at %s bits)", len(points),
             ", ".join(f"{b:g}" for b in cfg.search.seed_bits))
    return points
