"""The end of a search (a Hydra callback, conf/search.yaml: hydra.callbacks.qexp_search): the checks before the
first trial, and at the end the Pareto front of the finished trials, as a table, a plot and recipe YAMLs on the
sweep's parent run (and in `search.recipe_dir`).

The front is taken over the objectives the sweeper optimised, on the trials' selection-window figures: it says
which recipes to report, not how good they are; their test-window figures come from ordinary runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, List

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from qexp.core.search_config import OBJECTIVE_METRICS, SEARCH_KINDS, SEARCH_OBJECTIVES
from qexp.core.metrics import check as check_metrics

log = logging.getLogger("qexp")



def pareto_front(trials: pd.DataFrame, objectives: List[str]) -> pd.DataFrame:
    """The trials no other trial dominates (at least as good in every objective, better in one), one per recipe,
    sorted by bits."""
    signs = {name: 1.0 if SEARCH_OBJECTIVES[name] == "minimize" else -1.0 for name in objectives}
    values = pd.DataFrame({n: signs[n] * trials[OBJECTIVE_METRICS[n]].astype(float) for n in objectives})
    keep = []
    for i, row in values.iterrows():
        dominated = ((values <= row).all(axis=1) & (values < row).any(axis=1)).any()
        if not dominated:
            keep.append(i)
    front = trials.loc[keep].drop_duplicates(subset=["recipe"])
    return front.sort_values("bits").reset_index(drop=True)


def trials_table(client, experiment_id: str, parent_run_id: str, n_seeds: int) -> pd.DataFrame:
    """The finished trials of the sweep (child runs of its parent), one row each."""
    runs = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                              "attributes.status = 'FINISHED'", max_results=10000)
    rows = []
    for run in runs:
        m, p, t = run.data.metrics, run.data.params, run.data.tags
        num = int(t.get("qexp.sweep_job", -1))
        rows.append({"trial": num, "seed": 1 <= num <= n_seeds, "run_id": run.info.run_id, "recipe": t.get("recipe"),
                     **{c: m.get(c, float("nan")) for c in (*OBJECTIVE_METRICS.values(), "ppl_vs_fp_selection_ci_low",
                                                            "ppl_vs_fp_selection_ci_high", "lm_head_bits",
                                                            "weights_decoder_mb", "weights_lm_head_mb",
                                                            "decode_tok_s_est_err", "ppl_selection")},
                     **{f"promote_{k}": int(p.get(f"search.promote.{k}", 0)) for k in (*SEARCH_KINDS, "lm_head")}})
    return pd.DataFrame(rows).sort_values("trial").reset_index(drop=True) if rows else pd.DataFrame()


def _directions(config: DictConfig) -> List[str]:
    direction = OmegaConf.select(config, "hydra.sweeper.direction")
    values = OmegaConf.to_container(direction) if OmegaConf.is_config(direction) else direction
    return [str(getattr(d, "name", d)) for d in (values if isinstance(values, list) else [values])]


class SearchCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from qexp.core.errors import ConfigError, QexpError
        from qexp.search.run import validate_search

        try:
            validate_search(config, _directions(config))
            if OmegaConf.select(config, "hydra.sweeper.storage"):
                # optuna 2.10 (the sweeper's pin) fails on MLflow's SQLAlchemy 2 in its schema check (AssertionError)
                raise ConfigError("hydra.sweeper.storage: an Optuna RDB study does not work with the optuna 2.10 "
                                  "that hydra-optuna-sweeper pins and SQLAlchemy 2", "leave it unset: the study "
                                  "lives in memory and every trial is an MLflow run")
        except QexpError as exc:  # before any trial: the parent run (created just before) ends FAILED with it
            _fail_parent(config, f"qexp: error: {exc}")
            print(f"qexp: error: {exc}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._report(config)
        except Exception as exc:  # noqa: BLE001 - one line, the parent run FAILED with it, exit 1
            reason = (f"qexp: error: the search's front could not be written: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}")
            _fail_parent(config, reason)
            print(reason, file=sys.stderr)
            sys.exit(1)

    def _report(self, config: DictConfig) -> None:
        from mlflow.tracking import MlflowClient

        from qexp.search.plot import front_plot
        from qexp.tracking.sweep import SWEEP_FILE

        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # one line per recipe read back otherwise
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        info = json.loads((sweep_dir / SWEEP_FILE).read_text())
        client, parent = MlflowClient(info["tracking_uri"]), info["parent_run_id"]
        objectives = list(config.search.objectives)
        trials = trials_table(client, info["experiment_id"], parent, 1 + len(config.search.seed_bits))
        if trials.empty:
            print("qexp: search: no trial finished, no front", file=sys.stderr)
            return
        front = pareto_front(trials, objectives)
        out_dir = Path(config.search.recipe_dir) if config.search.recipe_dir else None
        for row in front.itertuples():
            text = Path(client.download_artifacts(row.run_id, "recipe.yaml", tempfile.mkdtemp())).read_text()
            client.log_text(parent, text, f"front/{row.recipe}.yaml")
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / f"{row.recipe}.yaml").write_text(text)
        client.log_text(parent, trials.to_csv(index=False), "search/trials.csv")
        client.log_text(parent, front.to_csv(index=False), "search/front.csv")
        with tempfile.TemporaryDirectory() as tmp:
            title = (f"{config.model.name}: {config.quant.name} + {config.sensitivity.high}, "
                     f"{len(trials)} trials (NSGA-II), selection windows")
            client.log_artifact(parent, str(front_plot(trials, front, Path(tmp) / "front.png", title)), "search")
        check_metrics(["search_trials_finished", "search_front_size"])
        client.log_metric(parent, "search_trials_finished", len(trials))
        client.log_metric(parent, "search_front_size", len(front))
        client.set_tag(parent, "qexp.search_objectives", ",".join(objectives))
        points = "; ".join(f"{r.bits:.3f} bits {r.ppl_vs_fp_selection:+.1%}" for r in front.itertuples())
        where = f"quant={out_dir.name}/<name> from {out_dir}" if out_dir else f"artifacts front/ of run {parent}"
        print(f"qexp: search front: {len(front)} recipes of {len(trials)} finished trials (selection windows): "
              f"{points}; recipes: {where}")


def _fail_parent(config: DictConfig, reason: str) -> None:
    from mlflow.tracking import MlflowClient

    from qexp.tracking.sweep import SWEEP_FILE

    sweep_file = Path(config.hydra.sweep.dir).resolve() / SWEEP_FILE
    if not sweep_file.exists():
        return
    info = json.loads(sweep_file.read_text())
    client = MlflowClient(info["tracking_uri"])
    client.set_tag(info["parent_run_id"], "error", reason)
    client.set_terminated(info["parent_run_id"], "FAILED")
