"""Sensitivity analysis and recipe synthesis (qexp/sensitivity) on the tiny model: the one-layer-on replay gives the
whole forward's numbers, the tracked run leaves its table, heatmap and recipes, a rerun is a cache hit with the same
table, a synthesized recipe is an ordinary quant config a run can use, and bad input is one line before any work."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY

SENS = TINY + ["quant=16a4w", "sensitivity.selection.seq_len=32", "sensitivity.selection.limit=4"]


@pytest.fixture(scope="module")
def compose_sensitivity(cache_dir, store_uri):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import qexp.backends  # noqa: F401
    from helpers import CONF

    def _compose(overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="sensitivity", overrides=[f"cache_dir={cache_dir}", f"tracking.uri={store_uri}",
                                                                  "tracking.experiment=tests", *overrides])
    return _compose


def test_the_analysis_config_is_the_run_config_plus_its_section(compose_sensitivity, compose):
    """conf/sensitivity.yaml composes conf/config.yaml: the quant group arrives whole (granularity, block size,
    annotations) less its overrides, and an experiment's config hash and params do not see the new section."""
    from qexp.core.provenance import config_hash

    cfg = compose_sensitivity(["quant=16a4w_block", "quant.block_size=64"])
    quant = cfg.quant
    assert (quant.weight_granularity.name, quant.block_size, list(quant.custom_annotations), list(quant.overrides)) \
        == ("per_block", 64, ["annotate_kv_8bit"], [])
    assert cfg.sensitivity.high == "16a8w" and cfg.sensitivity.selection.limit == 8
    from omegaconf import OmegaConf

    from qexp.cache import stable_hash
    from qexp.core.provenance import without_later_defaults
    from qexp.tracking.record import flatten

    run = compose(["quant=16a4w_block"], tracked=False)
    assert run.sensitivity is None and not any(k.startswith("sensitivity") for k in flatten(run))
    container = OmegaConf.to_container(run, resolve=True, enum_to_str=True)
    for volatile in ("tracking", "cache_dir", "cache", "verbose", "sensitivity", "device"):  # device: on the CPU
        container.pop(volatile)
    assert config_hash(run) == stable_hash(without_later_defaults(container), length=16)  # as before the section


def test_replay_from_any_layer_equals_the_whole_forward(compose_sensitivity):
    from qexp.models.static_llama import StaticLlama
    from qexp.pipeline import prepare
    from qexp.sensitivity.analysis import selection_windows
    from qexp.sensitivity.groups import model_groups
    from qexp.sensitivity.measure import GroupWeights, start_layer
    from qexp.sensitivity.replay import LayerReplay
    from qexp.quant.grid import WeightGrid

    cfg = compose_sensitivity(SENS)
    state = prepare(cfg, through="transform")
    windows = selection_windows(state, cfg)
    static = StaticLlama.private_copy(state.model, windows.seq_len, cfg.model)
    groups = model_groups({k: tuple(v.shape) for k, v in state.model.state_dict.items()})
    replay, weights = LayerReplay(static, windows), GroupWeights(static.module, groups)
    base = replay.record()
    assert np.array_equal(base, replay.loglik(0))
    for group in groups:
        weights.put(group, WeightGrid(2))  # a coarse grid: every group's change is visible
        try:
            partial, whole = replay.loglik(start_layer(group, static.n_layers)), replay.loglik(0)
        finally:
            weights.put(group, None)
        np.testing.assert_allclose(partial, whole, rtol=0, atol=1e-9, err_msg=group.name)
        assert not np.array_equal(partial, base), group.name
    assert np.array_equal(replay.loglik(0), base)  # every group restored to float


def test_a_tied_lm_head_and_embedding_are_quantized_apart(compose_sensitivity):
    """SmolLM2 ties its lm head to the embedding (one storage): putting one on a grid must leave the other."""
    import torch

    from qexp.pipeline import prepare
    from qexp.sensitivity.groups import model_groups
    from qexp.sensitivity.measure import GroupWeights
    from qexp.models.static_llama import StaticLlama
    from qexp.quant.grid import WeightGrid

    state = prepare(compose_sensitivity(SENS), through="load")
    module = StaticLlama.private_copy(state.model, 32, state.cfg.model).module
    table = module.tok_embeddings.weight
    module.output.conv.weight.data = table.data[:, :, None, None]  # tied, as a converted HF checkpoint can be
    assert module.output.conv.weight.data_ptr() == table.data_ptr()
    groups = {g.name: g for g in model_groups({k: tuple(v.shape) for k, v in state.model.state_dict.items()})}
    weights = GroupWeights(module, list(groups.values()))
    before = module.tok_embeddings.weight.detach().clone()
    weights.put(groups["lm_head"], WeightGrid(2))
    assert torch.equal(module.tok_embeddings.weight, before)
    assert not torch.equal(module.output.conv.weight[:, :, 0, 0], before)


def test_tracked_analysis_its_cache_and_a_recipe_a_run_uses(compose_sensitivity, compose, store_uri, tmp_path):
    from qexp.pipeline import run_experiment, validate
    from qexp.sensitivity.run import recipe_name, run_analysis
    from qexp.quant.grid import grid_for

    # its own cache: another test's identical analysis (the search sweep's) may have run in this worker first
    cfg = compose_sensitivity(SENS + [f"sensitivity.recipe_dir={tmp_path / 'quant'}", "sensitivity.budgets=[0.5]",
                                      "sensitivity.bit_budgets=[5.0]", f"cache_dir={tmp_path / 'cache'}"])
    run_id, first, recipes = run_analysis(cfg)
    table = first.table
    assert len(table) == 2 * 7 + 2 and set(table["projection"]) >= {"q", "down", "lm_head", "embedding"}
    for view in ("cost", "gain"):
        assert table[view].notna().all() and (table[f"{view}_ci_low"] <= table[f"{view}_ci_high"]).all()
    assert (table["sqnr_high_db"] > table["sqnr_low_db"]).all()  # 8-bit weights are closer to float than 4-bit
    assert (table["fisher_low"] >= table["fisher_high"]).all()
    assert -1 <= first.summary["spearman_cost_vs_sqnr"] <= 1
    client = MlflowClient(store_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["qexp.role"] == "sensitivity"
    artifacts = {a.path for a in client.list_artifacts(run_id, "sensitivity")}
    assert {"sensitivity/sensitivity.csv", "sensitivity/sensitivity_heatmap.png"} <= artifacts
    loose, five_bits = recipes  # +50%: every group low meets it (the tiny random model barely notices 4 bits)
    assert loose.met and loose.promoted == [] and loose.average_bits == pytest.approx(4.0)
    assert five_bits.kind == "bits" and 4.0 < five_bits.average_bits <= 5.0 and "lm_head" in five_bits.promoted
    assert run.data.metrics["recipe_500_met"] == 1.0 and run.data.metrics["recipe_b5_00_lm_head_bits"] == 8

    second = run_analysis(cfg)[1]
    assert second.cache_hit and not first.cache_hit
    pd.testing.assert_frame_equal(second.table, table)

    # the 5-bit recipe as an ordinary quant config: QnnQuantizer's grid is 8-bit exactly where it promoted
    name = recipe_name(cfg, five_bits)
    run_cfg = compose(TINY + [f"quant={name}", f"hydra.searchpath=[file://{tmp_path}]"])
    validate(run_cfg)
    assert run_cfg.quant.name == name and run_cfg.quant.overrides
    groups = {g.name: g for g in first.groups}
    for group in groups.values():
        if group.in_recipes:
            expected = 8 if group.name in five_bits.promoted else 4
            assert grid_for(run_cfg.quant, group.meta_key).bits == expected, group.name
    metrics = run_experiment(run_cfg).metrics
    assert metrics["ppl_qdq"] > 0
    # the run's size measure is the recipe's: bits per decoder-linear weight, the lm head apart
    assert metrics["weight_bits_decoder"] == pytest.approx(five_bits.average_bits)
    assert metrics["weight_bits_lm_head"] == 8 and metrics["weights_htp_lm_head_mb"] > 0


def test_low_weights_algorithms_measures_the_program_the_rounding_algorithms_deploy(compose_sensitivity):
    """With low_weights=algorithms the analysis measures from the rotated model; every group at the low grid is
    exactly what weight clipping + GPTQ deploy (so the all-low perplexity is the stacked model's), at the high grid
    the rotated weights rounded to nearest. Round-to-nearest of GPTQ's weights would make every gain nil."""
    import torch

    from qexp.sensitivity.analysis import analyse
    from qexp.sensitivity.groups import TensorGrid
    from qexp.sensitivity.measure import GroupWeights
    from qexp.sensitivity.replay import LayerReplay, perplexity
    from qexp.models.static_llama import StaticLlama

    stack = SENS + ["algorithm=[rotation,weight_clip,gptq]", "sensitivity.views=[gain]"]
    from qexp.sensitivity.program import recipe_tag

    program_cfg = compose_sensitivity(stack + ["sensitivity.low_weights=algorithms"])
    assert recipe_tag(program_cfg) == "_weight_clip_gptq" and recipe_tag(compose_sensitivity(stack)) == ""
    program = analyse(program_cfg)
    rtn = analyse(compose_sensitivity(stack))
    assert program.model.transforms == ("rotation",) and rtn.model.transforms == ("rotation", "weight_clip", "gptq")
    assert program.tags["sensitivity_low_weights"] == "algorithms" and program.program is not None
    deployed = rtn.state.deploy_model
    static = StaticLlama.private_copy(deployed, program.selection.seq_len, rtn.state.cfg.model)
    params = dict(static.module.named_parameters())
    recipe_groups = [g for g in program.groups if g.in_recipes]
    assert sorted(program.program.weights) == sorted(g.name for g in recipe_groups)
    for g in recipe_groups:  # GPTQ's weights are on their grid: rounding them onto their exact scales keeps them
        if g.layer is None:  # GPTQ rounds the decoder layers; the lm head is round-to-nearest on weight_clip's scales
            continue
        deployed_w = params[f"{g.module_path}.weight"].detach()
        torch.testing.assert_close(program.program.weights[g.name].reshape(deployed_w.shape), deployed_w,
                                   rtol=0, atol=1e-6, msg=g.name)
    weights = GroupWeights(static.module, program.groups, program.program)
    weights.put_all(lambda g: program.low if g.in_recipes else TensorGrid(8))  # the gain view's base: all low
    stacked = perplexity(LayerReplay(static, program.selection).loglik(0))
    assert program.summary["ppl_all_low_selection"] == pytest.approx(stacked, rel=1e-6)
    # RTN of the stacked weights: promoting a GPTQ'd group to 8 bits moves it by less than a 4-bit step's rounding
    # a subset of groups: the others keep the stack's weights, as in an rtn analysis
    subset = analyse(compose_sensitivity(stack + ["sensitivity.low_weights=algorithms", "sensitivity.groups=down"]))
    kept, analysed = "layers.1.attention.wq.weight", "layers.1.feed_forward.w2.weight"
    assert torch.equal(subset.model.state_dict[kept], deployed.state_dict[kept])
    assert torch.equal(subset.model.state_dict[analysed], program.model.state_dict[analysed])
    assert not torch.equal(subset.model.state_dict[analysed], deployed.state_dict[analysed])
    decoder = [g.name for g in recipe_groups if g.layer is not None]
    gains, nil = (a.table.set_index("group").loc[decoder, "gain"].abs().mean() for a in (program, rtn))
    assert gains > 5 * nil


def test_synthesis_finds_the_fewest_promotions_and_says_when_a_budget_cannot_be_met():
    """With a known response (each promotion removes its group's share of the loss), the bisection returns the
    shortest prefix of the order that meets the budget; a budget below all-high is reported, not faked."""
    from qexp.sensitivity.groups import Group
    from qexp.sensitivity.synthesis import synthesize, within_bits

    groups = [Group(f"layers.{i}.down", f"layers.{i}.feed_forward.w2.weight", i, "down", 100) for i in range(6)]
    groups.append(Group("lm_head", "output.weight", None, "lm_head", 600))
    loss = {"layers.0.down": 0.01, "layers.1.down": 0.08, "layers.2.down": 0.02, "layers.3.down": 0.04,
            "layers.4.down": 0.0, "layers.5.down": 0.005, "lm_head": 0.1}
    table = pd.DataFrame([{"group": g.name, "cost": loss[g.name], "gain": -loss[g.name], "bits_low": 4.0,
                           "bits_high": 8.0} for g in groups])

    def measure(promoted):
        return 0.002 + sum(v for k, v in loss.items() if k not in promoted)

    recipe = synthesize(table, groups, 0.05, measure)
    # order: lm head (no decoder bits), then 1, 3, 2, 0, 5, 4; +5% needs the lm head, 1 and 3 (0.037 left)
    assert recipe.met and recipe.promoted == ["lm_head", "layers.1.down", "layers.3.down"]
    assert recipe.average_bits == pytest.approx(4 + 4 * 2 / 6) and recipe.lm_head_bits == 8
    missed = synthesize(table, groups, 0.001, measure)
    assert not missed.met and "no recipe meets" in missed.notes[0] and len(missed.promoted) == len(groups)
    from qexp.sensitivity.run import unmet_budget_lines

    lines = unmet_budget_lines(OmegaConf.create({"model": {"name": "m"}, "quant": {"name": "q"}}), [recipe, missed])
    assert len(lines) == 1 and lines[0].startswith("qexp: error: no recipe meets +0.1%") and "mp_m_q_001" in lines[0]
    capped = within_bits(table, groups, 5.0, measure)  # one of six layers at 8 bits: 4.67 bits
    assert capped.promoted == ["lm_head", "layers.1.down"] and capped.ppl_ratio_selection == pytest.approx(0.077)


@pytest.mark.parametrize("override,message", [
    ("quant=fp32", "needs a low precision"),
    ("quant=16a2w", "asymmetric codes [-2, 1]"),
    ("sensitivity.groups=layers\\.9\\.", "matches no group"),
    ("sensitivity.groups='('", "not a valid regex"),
    ("sensitivity.high=16a4w", "not more precise"),
    ("sensitivity.budgets=[-0.05]", "budgets"),
    ("sensitivity.views=[cost,loss]", "sensitivity.views"),
    ("sensitivity.bit_budgets=[3.5]", "outside [4, 8]"),
    ("sensitivity.low_weights=gptq", "choose one of: rtn, algorithms"),
    ("sensitivity.low_weights=algorithms", "does not end with a weight-rounding algorithm"),
    (["algorithm=[weight_clip,rotation]", "sensitivity.low_weights=algorithms"], "would not keep the weight scales"),
])
def test_bad_analysis_input_is_refused_before_work(compose_sensitivity, override, message):
    from qexp.core.errors import ConfigError
    from qexp.sensitivity.analysis import validate_analysis

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_analysis(compose_sensitivity(SENS + (override if isinstance(override, list) else [override])))


def test_bad_analysis_input_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "qexp.sensitivity", *SENS, "quant=fp32", "tracking.experiment=tests"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("qexp: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "needs a low precision" in lines[0], proc.stderr[-2000:]
    assert "MLflow run" not in proc.stderr  # refused before a run started
