"""`python -m qexp.sensitivity [model=...] [quant=LOW] [sensitivity.high=HIGH] ...`: one sensitivity analysis."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
from qexp.core.errors import one_line
from qexp.core.redact import mask_log_records

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
mask_log_records()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="sensitivity")
def main(cfg: DictConfig) -> None:
    from qexp.sensitivity.run import recipe_name, run_analysis, unmet_budget_lines

    try:
        run_id, analysis, recipes = run_analysis(cfg)
    except KeyboardInterrupt:
        print("qexp: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - one line; details in the MLflow run
        message, status = one_line(exc)
        print(message, file=sys.stderr)
        sys.exit(status)
    s = analysis.summary
    print(f"qexp: sensitivity run {run_id} finished: {len(analysis.groups)} groups on {s['selection_windows']} "
          f"selection windows x {s['selection_window_len']} tokens "
          f"({'from the cache; measured' if analysis.cache_hit else 'measured'} in {s['analysis_s']:.0f} s)")
    for recipe in recipes:
        budget = f"<= {recipe.budget:g} bits" if recipe.kind == "bits" else f"+{recipe.budget:.1%}"
        print(f"qexp: recipe {recipe_name(cfg, recipe)}: {recipe.average_bits:.3f} bits per decoder-linear weight "
              f"(lm head {recipe.lm_head_bits:g}), "
              f"{recipe.ppl_ratio_selection:+.2%} vs FP on the selection windows "
              f"({'meets' if recipe.met else 'MISSES'} {budget})")
    unmet = unmet_budget_lines(cfg, recipes)
    if unmet:  # the run and its closest recipes are kept; the exit status says a budget was not met
        print("\n".join(unmet), file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
