"""`python -m qexp.sensitivity`: the analysis as a tracked MLflow run, its table, heatmap and recipes as artifacts.

Recipes are synthesized for each budget (qexp/sensitivity/synthesis.py), measured on the selection windows, and
written as conf/quant-style YAMLs tagged with the analysis run; `sensitivity.recipe_dir` also writes them where a
run can use them (e.g. conf/quant/mixed -> `quant=mixed/<name>`).
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import List


from qexp.sensitivity.analysis import Analysis, analyse, validate_analysis
from qexp.sensitivity.synthesis import Recipe, recipe_overrides, recipe_yaml, synthesize, within_bits

log = logging.getLogger("qexp")


def run_analysis(cfg) -> tuple[str, Analysis, List[Recipe]]:
    """Validate, then the tracked run. Returns (run id, analysis, recipes)."""
    from qexp.core.provenance import config_hash, environment_tags
    from qexp.tracking.runlog import captured_log
    from qexp.tracking.record import config_yaml, flatten
    from qexp.tracking.store import Tracker

    validate_analysis(cfg)
    tracker = Tracker(cfg.tracking)
    with captured_log(verbose=bool(cfg.verbose)) as run_log:
        name = cfg.tracking.run_name or f"{cfg.model.name} · sensitivity {cfg.quant.name} vs {cfg.sensitivity.high}"
        run_id = tracker.start(name, {"qexp.role": "sensitivity", "config_hash": config_hash(cfg),
                                      **environment_tags()})
        try:
            Tracker.params(flatten(cfg))
            Tracker.text(config_yaml(cfg), "config.yaml")
            analysis = analyse(cfg)
            recipes = _recipes(cfg, analysis, run_id)
            _log_results(cfg, analysis, recipes, run_id)
            tracker.end(run_log.getvalue())
        except BaseException as exc:
            tracker.end(run_log.getvalue(), exc)
            raise
    return run_id, analysis, recipes


def recipe_measure(cfg, analysis: Analysis):
    """promoted group names -> ppl / ppl_fp - 1 on the selection windows (weights fake-quantized, one forward)."""
    from qexp.core.device import move
    from qexp.models.static_llama import StaticLlama
    from qexp.sensitivity.groups import grids_for
    from qexp.sensitivity.measure import GroupWeights
    from qexp.sensitivity.replay import LayerReplay, perplexity

    static = StaticLlama.private_copy(analysis.model, analysis.selection.seq_len, cfg.model)  # weights edited in place
    move(static.module, analysis.state.device)  # on the run's device, as the analysis measured
    replay = LayerReplay(static, analysis.selection)
    weights = GroupWeights(static.module, analysis.groups, analysis.program)
    fp_ppl = perplexity(replay.loglik(0))

    def measure(promoted: List[str]) -> float:
        chosen = set(promoted)

        def grid(g):  # the embedding is not a recipe's choice: at the 16-bit activations' per-tensor grid
            low, high = grids_for(g, analysis.low, analysis.high)
            return high if g.name in chosen or not g.in_recipes else low

        weights.put_all(grid)
        return perplexity(replay.loglik(0)) / fp_ppl - 1

    return measure


def _recipes(cfg, analysis: Analysis, run_id: str) -> List[Recipe]:
    if not cfg.sensitivity.budgets and not cfg.sensitivity.bit_budgets:
        return []
    measure = recipe_measure(cfg, analysis)
    recipes = [synthesize(analysis.table, analysis.groups, b, measure) for b in sorted(cfg.sensitivity.budgets)]
    recipes += [within_bits(analysis.table, analysis.groups, b, measure) for b in sorted(cfg.sensitivity.bit_budgets)]
    for recipe in recipes:
        log.info("recipe %s: %d groups at %s, %.3f bits per decoder-linear weight (lm head %g), %+.2f%% vs FP on "
                 "the selection windows%s", recipe_name(cfg, recipe), len(recipe.promoted), cfg.sensitivity.high,
                 recipe.average_bits, recipe.lm_head_bits,
                 100 * recipe.ppl_ratio_selection, "" if recipe.met else " (budget NOT met)")
        for note in recipe.notes:
            log.warning(note)
    return recipes


def budget_label(recipe: Recipe) -> str:
    """ppl budget +5% -> "050"; bits budget 4.5 -> "b4_50"."""
    if recipe.kind == "bits":
        return f"b{recipe.budget:.2f}".replace(".", "_")
    return f"{int(round(recipe.budget * 1000)):03d}"


def recipe_name(cfg, recipe: Recipe) -> str:
    """mp_<model>_<quant>_<budget>; with low_weights=algorithms the rounding algorithms come before the budget
    (mp_<model>_<quant>_weight_clip_gptq_b5_00), so such a recipe never takes an RTN recipe's name."""
    from qexp.sensitivity.program import recipe_tag

    return f"mp_{cfg.model.name}_{cfg.quant.name}{recipe_tag(cfg)}_{budget_label(recipe)}"


def _log_results(cfg, analysis: Analysis, recipes: List[Recipe], run_id: str) -> None:
    from qexp.sensitivity.plot import heatmap
    from qexp.tracking.store import Tracker

    Tracker.tags(analysis.tags)
    Tracker.metrics({k: v for k, v in analysis.summary.items() if isinstance(v, (int, float)) and math.isfinite(v)})
    Tracker.text(analysis.table.to_csv(index=False), "sensitivity/sensitivity.csv")
    with tempfile.TemporaryDirectory() as tmp:
        title = (f"{cfg.model.name}: {analysis.low.describe()}{low_note(analysis)} vs {analysis.high.describe()}, "
                 f"{analysis.selection.n_windows} selection windows x {analysis.selection.seq_len} tokens")
        Tracker.file(heatmap(analysis.table, Path(tmp) / "sensitivity_heatmap.png", title), "sensitivity")
    out_dir = Path(cfg.sensitivity.recipe_dir) if cfg.sensitivity.recipe_dir else None
    for recipe in recipes:
        name = recipe_name(cfg, recipe)
        note = f"sensitivity run {run_id[:8]}"
        budget = (f"at most {recipe.budget:g} bits per weight" if recipe.kind == "bits"
                  else f"+{recipe.budget:.1%} vs FP on the selection windows")
        header = (f"Synthesized by python -m qexp.sensitivity (MLflow run {run_id}) for {cfg.model.name}: budget "
                  f"{budget} ({'met' if recipe.met else 'NOT met'}); on the selection windows "
                  f"{recipe.ppl_ratio_selection:+.2%} vs FP, {recipe.average_bits:.3f} bits per decoder-linear weight, "
                  f"lm head {recipe.lm_head_bits:g} bits.\n"
                  f"Low {analysis.low.describe()}{low_note(analysis)}, high {cfg.sensitivity.high} per channel; "
                  "the lm head's bits are said apart. Report it on the test windows: "
                  "python -m qexp quant=<this recipe>.")
        text = recipe_yaml(cfg.quant, recipe, recipe_overrides(analysis.groups, recipe.promoted,
                                                                cfg.sensitivity.high, note), name, header)
        Tracker.text(text, f"recipes/{name}.yaml")
        budget = budget_label(recipe)
        metrics = {"bits": recipe.average_bits, "lm_head_bits": recipe.lm_head_bits, "met": float(recipe.met),
                   "ppl_vs_fp_selection": recipe.ppl_ratio_selection, "promoted": len(recipe.promoted)}
        Tracker.metrics({f"recipe_{budget}_{k}": v for k, v in metrics.items() if math.isfinite(v)})
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{name}.yaml").write_text(text)
            log.info("recipe written: %s", out_dir / f"{name}.yaml")


def low_note(analysis: Analysis) -> str:
    return " (weights as the algorithms round them)" if analysis.program is not None else ""


def unmet_budget_lines(cfg, recipes) -> list:
    """One line per budget no recipe meets, naming the closest recipe written."""
    return [f"qexp: error: {recipe.notes[0] if recipe.notes else 'budget not met'}; the closest recipe is "
            f"{recipe_name(cfg, recipe)} (in the run's recipes/)" for recipe in recipes if not recipe.met]

