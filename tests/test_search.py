"""The mixed-precision search (qexp/search) on the tiny model: a real Hydra Optuna sweep (NSGA-II) whose trials are
MLflow child runs, seeded by the greedy recipes, ending in a Pareto front of recipes a run can use; a point measured
alone gives the sweep's numbers; bad input is one line before any trial."""

from __future__ import annotations

import re
import subprocess
import sys

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY

SEARCH = TINY + ["quant=16a4w", "sensitivity.selection.seq_len=32", "sensitivity.selection.limit=4",
                 "search.selection.seq_len=32", "search.selection.limit=4"]


@pytest.fixture(scope="module")
def compose_search(cache_dir, store_uri):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import qexp.backends  # noqa: F401
    from helpers import CONF

    def _compose(overrides, hydra_config=False):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="search", return_hydra_config=hydra_config, overrides=[
                f"cache_dir={cache_dir}", f"tracking.uri={store_uri}", "tracking.experiment=tests-search", *overrides])
    return _compose


def test_the_search_config_is_the_analysis_config_plus_an_optuna_sweeper(compose_search, compose):
    from qexp.tracking.record import flatten

    cfg = compose_search(SEARCH, hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.sampler._target_.endswith("NSGAIISampler")
    assert list(sweeper.direction) == ["minimize", "minimize"] and list(cfg.search.objectives) == ["ppl", "bits"]
    assert sweeper.custom_search_space == "qexp.search.space.define" and cfg.sensitivity.high == "16a8w"
    run = compose(["quant=16a4w"], tracked=False)
    assert run.search is None and not any(k.startswith("search") for k in flatten(run))


def test_pareto_front_keeps_the_undominated_recipes():
    from qexp.search.front import pareto_front

    trials = pd.DataFrame({"recipe": ["a", "b", "c", "d", "b"], "bits": [4.0, 4.5, 4.5, 5.0, 4.5],
                           "ppl_vs_fp_selection": [0.20, 0.10, 0.12, 0.10, 0.10], "decode_tok_s_est": [9, 8, 9, 7, 8]})
    assert list(pareto_front(trials, ["ppl", "bits"])["recipe"]) == ["a", "b"]  # d: same ppl, more bits; c: worse
    # with speed as a third objective c is on the front (faster than b at the same bits)
    assert list(pareto_front(trials, ["ppl", "bits", "decode_tok_s"])["recipe"]) == ["a", "b", "c"]


def test_a_search_sweep_its_trials_front_and_recipes(tmp_path, cache_dir, store_uri, compose):
    from qexp.quant.grid import grid_for

    recipes, sweep_dir = tmp_path / "quant", tmp_path / "sweep"
    args = [*SEARCH, f"cache_dir={cache_dir}", f"tracking.uri={store_uri}", "tracking.experiment=tests-search",
            "hydra.sweeper.n_trials=8", "hydra.sweeper.sampler.population_size=4", "search.seed_bits=[5.0]",
            "search.objectives=[ppl,bits,decode_tok_s]", "hydra.sweeper.direction=[minimize,minimize,maximize]",
            f"search.recipe_dir={recipes}", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run([sys.executable, "-m", "qexp.search", "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 finished, 0 failed" in proc.stdout and "qexp: search front:" in proc.stdout
    client = MlflowClient(store_uri)
    experiment = client.get_experiment_by_name("tests-search")
    parent = client.search_runs([experiment.experiment_id], "tags.`qexp.role` = 'sweep'")[0]
    assert parent.info.status == "FINISHED" and parent.data.metrics["search_trials_finished"] == 8
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 8 and all(c.data.tags["qexp.role"] == "search_trial" for c in children)
    by_job = {int(c.data.tags["qexp.sweep_job"]): c for c in children}
    uniform = by_job[1]  # the first seed: every group low but the lm head
    assert uniform.data.params["search.promote.lm_head"] == "1" and uniform.data.metrics["bits"] == 4.0
    assert uniform.data.metrics["lm_head_bits"] == 8 and uniform.data.metrics["decode_tok_s_est"] > 0
    assert 4.0 < by_job[2].data.metrics["bits"] <= 5.0  # the greedy seed at 5 bits
    names = {a.path for a in client.list_artifacts(parent.info.run_id, "search")}
    assert {"search/front.csv", "search/trials.csv", "search/front.png"} <= names
    front = pd.read_csv(client.download_artifacts(parent.info.run_id, "search/front.csv", str(tmp_path)))
    assert len(front) == parent.data.metrics["search_front_size"] and set(front["recipe"]) == \
        {p.stem for p in recipes.glob("*.yaml")}

    # a front recipe is an ordinary quant config: 8-bit exactly where its trial promoted
    row = front.iloc[-1]
    run_cfg = compose(TINY + [f"quant={row.recipe}", f"hydra.searchpath=[file://{tmp_path}]"], tracked=False)
    trial = client.get_run(row.run_id)
    assert run_cfg.quant.name == row.recipe
    promoted = int(trial.data.metrics["promoted"])
    eight = [k for k in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight", "output.weight")
             if grid_for(run_cfg.quant, k).bits == 8]
    assert promoted >= len(eight) and (promoted == 0) == (not run_cfg.quant.overrides)

    # the same point measured alone (no sweep) gives the sweep's numbers
    point = [f"search.promote.{k}={trial.data.params[f'search.promote.{k}']}"
             for k in ("q", "k", "v", "o", "gate", "up", "down", "lm_head")]
    alone = subprocess.run([sys.executable, "-m", "qexp.search", *args[:-4], *point], cwd=REPO, capture_output=True,
                           text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert f"{100 * trial.data.metrics['ppl_vs_fp_selection']:+.2f}%" in alone.stdout


@pytest.mark.parametrize("override,message", [
    ("search.objectives=[ppl,speed]", "search.objectives"),
    ("hydra.sweeper.direction=[minimize,maximize]", "give hydra.sweeper.direction=[minimize,minimize]"),
    ("search.promote.down=9", "outside [0, 2]"),
    ("+search.promote.mlp=1", "no such projection kind"),
    ("search.seed_bits=[9.0]", "search.seed_bits"),
    ("search.soc=SM0000", "SM0000"),
    ("quant=fp32", "needs a low precision"),
])
def test_bad_search_input_is_refused_before_work(compose_search, override, message):
    from qexp.core.errors import ConfigError
    from qexp.search.front import _directions
    from qexp.search.run import validate_search

    cfg = compose_search(SEARCH + [override], hydra_config=True)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_search(cfg, _directions(cfg))


@pytest.mark.parametrize("override,message", [
    ("search.objectives=[ppl,speed]", "search.objectives"),
    (f"hydra.sweeper.storage=sqlite:///{REPO}/optuna.db", "hydra.sweeper.storage"),
])
def test_bad_search_input_is_one_line_exit_2_and_a_failed_parent(tmp_path, cache_dir, store_uri, override, message):
    experiment_name = f"tests-search-bad-{message.split('.')[-1]}"
    proc = subprocess.run([sys.executable, "-m", "qexp.search", "-m", *SEARCH, f"cache_dir={cache_dir}",
                           f"tracking.uri={store_uri}", f"tracking.experiment={experiment_name}", override,
                           f"hydra.sweep.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("qexp: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    client = MlflowClient(store_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment_name).experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"] and message in runs[0].data.tags["error"]
    assert not (REPO / "optuna.db").exists()
