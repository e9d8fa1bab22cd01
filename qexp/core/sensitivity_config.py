"""The sensitivity analysis' settings (conf/sensitivity.yaml; the `sensitivity` section of the top-level config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

SENSITIVITY_VIEWS = ("cost", "gain")
LOW_WEIGHTS = ("rtn", "algorithms")


@dataclass
class SelectionConfig:
    # windows of the calibration half of the text, from its second half by characters (the calibration samples come
    # from its start; checked disjoint): never the test windows the recipes are reported on
    seq_len: int = 96  # 8 x 96 tokens: SmolLM2's whole analysis fits 15 minutes on 2 cores
    limit: int = 8


@dataclass
class SensitivityConfig:
    """`python -m qexp.sensitivity` (conf/sensitivity.yaml): the run's `quant` is the low precision (its scheme,
    granularity and block size; its overrides are what the analysis decides), `high` the high one (per channel)."""

    high: str = "16a8w"
    groups: str = ".*"  # regex over group names (layers.3.down, lm_head, embedding)
    views: List[str] = field(default_factory=lambda: list(SENSITIVITY_VIEWS))
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    # perplexity budgets (ppl / ppl_fp - 1 on the selection windows) to synthesize recipes for
    budgets: List[float] = field(default_factory=lambda: [0.03, 0.05, 0.10])
    # average-bits budgets (per decoder-linear weight) to synthesize the best recipe within
    bit_budgets: List[float] = field(default_factory=list)
    # the low precision's weights: rtn, the (transformed) float weights rounded to nearest; algorithms, the weights
    # the run's trailing weight-rounding algorithms (weight_clip, gptq) deploy, the rest measured from the model
    # before them (qexp/sensitivity/program.py)
    low_weights: str = "rtn"
    # where the recipes go as conf/quant-style YAMLs (quant=<dir name>/<file> when inside conf/quant); empty: only
    # the run's artifacts
    recipe_dir: str = ""
