"""A search trial as a tracked MLflow run (a child of the sweep's parent run), and the checks of a search config."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

from qexp.core.search_config import SEARCH_KINDS, SEARCH_OBJECTIVES
from qexp.core.errors import ConfigError

log = logging.getLogger("qexp")

ROLE = "search_trial"


def validate_search(cfg, directions: Optional[Sequence[str]] = None) -> None:
    """One line for a search config that cannot work, before any model is loaded. `directions`: the sweeper's."""
    from qexp.sensitivity.analysis import high_grid, low_grid, validate_analysis
    from qexp.quant.grid import grid_bits
    from qexp.speed import check_soc, model_shapes

    s = cfg.search
    names = list(s.objectives)
    unknown = [n for n in names if n not in SEARCH_OBJECTIVES]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(f"search.objectives={names}",
                          f"choose distinct objectives from: {', '.join(SEARCH_OBJECTIVES)}")
    if directions is not None:
        given = [str(getattr(d, "name", d)) for d in directions]
        wanted = [SEARCH_OBJECTIVES[n] for n in names]
        if given != wanted:
            raise ConfigError(f"hydra.sweeper.direction={given} does not fit search.objectives={names}",
                              f"give hydra.sweeper.direction=[{','.join(wanted)}]")
    validate_analysis(cfg)
    n_layers = model_shapes(cfg.model).n_layers
    for kind, count in s.promote.items():
        top = 1 if kind == "lm_head" else n_layers
        if kind not in (*SEARCH_KINDS, "lm_head"):
            raise ConfigError(f"search.promote.{kind}: no such projection kind",
                              f"the kinds are {', '.join(SEARCH_KINDS)} and lm_head")
        if not 0 <= int(count) <= top:
            raise ConfigError(f"search.promote.{kind}={count} outside [0, {top}]",
                              f"{cfg.model.name} has {n_layers} layers" if top > 1 else "lm_head is 0 or 1")
    low, high = grid_bits(low_grid(cfg.quant)), grid_bits(high_grid(cfg.sensitivity.high))
    bad = [b for b in s.seed_bits if not low <= b <= high]
    if bad:
        raise ConfigError(f"search.seed_bits {bad} outside [{low:g}, {high:g}]",
                          "give average bits between the low and the high precision's")
    if s.selection.limit < 2 or s.selection.seq_len < 16:
        raise ConfigError(f"search.selection={dict(s.selection)}: too little selection data",
                          "use selection.limit >= 2 windows of seq_len >= 16 tokens")
    check_soc(s.soc)


def recipe_name(cfg, bits: float) -> str:
    from qexp.sensitivity.program import recipe_tag

    return f"ms_{cfg.model.name}_{cfg.quant.name}{recipe_tag(cfg)}_b{bits:.3f}".replace(".", "_")


def run_trial(cfg, job=None) -> Tuple[str, object]:
    """Measure the config's point as one tracked run; returns (run id, TrialResult)."""
    from qexp.core.provenance import config_hash, environment_tags
    from qexp.search.trial import evaluator_for
    from qexp.sensitivity.synthesis import recipe_yaml
    from qexp.tracking.runlog import captured_log
    from qexp.tracking.record import config_yaml, flatten
    from qexp.tracking.store import Tracker

    validate_search(cfg)
    tracker = Tracker(cfg.tracking, patient=job is not None)
    with captured_log(verbose=bool(cfg.verbose)) as run_log:
        point = " ".join(f"{k}{v}" for k, v in cfg.search.promote.items() if int(v))
        name = cfg.tracking.run_name or f"{cfg.model.name} · search {cfg.quant.name} + {cfg.sensitivity.high}: " \
                                        f"{point or 'none promoted'}"
        tags = {"qexp.role": ROLE, "config_hash": config_hash(cfg), **environment_tags(), **(job.tags() if job else {})}
        run_id = tracker.start(name, tags)
        try:
            Tracker.params(flatten(cfg))
            Tracker.text(config_yaml(cfg), "config.yaml")
            evaluator = evaluator_for(cfg)
            result = evaluator.evaluate(cfg)
            Tracker.tags({**evaluator.analysis.tags, "search_windows_sha256": evaluator.windows.sha256,
                          "search_windows": f"{evaluator.windows.n_windows} x {evaluator.windows.seq_len}",
                          "estimate": result.speed.source})
            Tracker.metrics({k: v for k, v in result.metrics().items() if v == v})
            recipe = recipe_name(cfg, result.bits)
            header = (f"Proposed by the mixed-precision search (python -m qexp.search; trial run {run_id}) for "
                      f"{cfg.model.name}: {result.bits:.3f} bits per decoder-linear weight, lm head "
                      f"{result.lm_head_bits:g} bits; {result.ppl_ratio:+.2%} vs FP on the search's selection windows "
                      f"({evaluator.windows.n_windows} x {evaluator.windows.seq_len} tokens of the calibration half).\n"
                      "Report it on the test windows: python -m qexp quant=<this recipe>.")
            Tracker.text(recipe_yaml(cfg.quant, None, result.overrides, recipe, header), "recipe.yaml")
            Tracker.tags({"recipe": recipe})
            tracker.end(run_log.getvalue())
        except BaseException as exc:
            tracker.end(run_log.getvalue(), exc)
            raise
    if job is not None:
        job.record("finished", run_id, tags["config_hash"])
    return run_id, result
