"""Upstream's per-model quant recipes as presets (conf/quant/recipe_*.yaml, conf/experiment/recipe_*.yaml): each
composes for its model with only a path, puts every weight layer on the grid upstream's recipe gives it (the 8-bit
overrides, LPBQ blocks elsewhere), and an override that selects no layer is refused before any work."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY, program_weights
from qexp.cache import Cache
from qexp.core.errors import ConfigError
from qexp.models.sources import load_model
from qexp.pipeline import prepare, validate
from qexp.models.shapes import static_module_path
from qexp.quant.grid import grid_for

# recipe preset -> the tiny family standing in for its model (same layer names; tiny dims divide every block size)
RECIPES = {"recipe_qwen2_5_0_5b": "qwen2", "recipe_qwen3_0_6b": "qwen3", "recipe_llama3_2_1b": "llama",
           "recipe_gemma3_1b": "gemma3"}
# what upstream's recipe keeps at 8 bits per channel, by Meta weight name of the 2-layer tiny models
EIGHT_BIT = {"recipe_qwen2_5_0_5b": set(),
             "recipe_qwen3_0_6b": {"layers.0.feed_forward.w2.weight", "layers.1.feed_forward.w2.weight"},
             "recipe_llama3_2_1b": {"output.weight", "layers.0.feed_forward.w2.weight",
                                    "layers.1.feed_forward.w2.weight"},
             "recipe_gemma3_1b": {"layers.0.attention.wv.weight", "layers.1.attention.wv.weight"}}
BLOCK = {"recipe_qwen2_5_0_5b": 16, "recipe_qwen3_0_6b": 32, "recipe_llama3_2_1b": 32, "recipe_gemma3_1b": 64}


def tiny(family: str) -> list:
    return TINY if family == "llama" else [f"model=tiny_{family}" if o == "model=tiny" else o for o in TINY]


def layer_keys(model) -> list:
    return [k for k, v in model.state_dict.items()
            if v.dim() == 2 and (k.startswith("layers.") or k == "output.weight")]


def assert_program_on_grids(state) -> dict:
    """Every conv weight of the converted program equals grid_for(...)'s fake quantization of the Meta weight;
    returns {Meta key: (weight bits, scales per row)}."""
    weights = program_weights(state.qdq.program.module)
    seen = {}
    for key in layer_keys(state.model):
        grid = grid_for(state.cfg.quant, key)
        name, expected = state.deploy_static.static_layout(key, grid.quantize(state.model.state_dict[key]))
        ints, scale = weights[name]
        rows = ints.reshape(ints.shape[0], -1).float()
        scale = scale.reshape(ints.shape[0], -1)
        got = rows * scale.repeat_interleave(rows.shape[1] // scale.shape[1], 1)
        assert torch.allclose(got, expected, rtol=0, atol=1e-6), key
        assert int(ints.abs().max()) <= grid.qmax, key
        seen[key] = (grid.bits, scale.shape[1])
    return seen


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_puts_each_layer_on_upstreams_grid(recipe, compose):
    state = prepare(compose(tiny(RECIPES[recipe]) + [f"quant={recipe}"]), through="qdq")
    seen = assert_program_on_grids(state)
    for key, (bits, blocks) in seen.items():
        if key in EIGHT_BIT[recipe]:
            assert (bits, blocks) == (8, 1), key
        else:
            cols = state.model.state_dict[key].shape[1]
            assert (bits, blocks) == (4, cols // BLOCK[recipe]), key
    kv8 = "annotate_kv_8bit" in state.cfg.quant.custom_annotations
    assert kv8 == (recipe in ("recipe_llama3_2_1b", "recipe_gemma3_1b"))  # upstream's KV I/O bits: 8 for these two


def test_the_last_matching_override_wins_as_in_qnnquantizer(compose):
    """Two overrides on one layer: QnnQuantizer orders equal-priority strategies latest first, and grid_for (what the
    algorithms search against) must agree with the program."""
    state = prepare(compose(TINY + [
        "quant=16a4w_block",
        "quant.overrides=[{pattern: feed_forward, scheme: 16a8w}, {pattern: layers.0.feed_forward.w2_conv, "
        "scheme: 16a4w}]"]), through="qdq")
    seen = assert_program_on_grids(state)
    assert seen["layers.0.feed_forward.w2.weight"] == (4, 1)  # the later, 4-bit per-channel override
    assert seen["layers.1.feed_forward.w2.weight"] == (8, 1)
    assert seen["layers.0.attention.wq.weight"] == (4, 2)  # the scheme's blocks of 32 over 64 inputs


@pytest.mark.parametrize("experiment,model,family", [
    ("recipe_qwen2_5_0_5b", "qwen2_5_0_5b", "qwen2"), ("recipe_qwen3_0_6b", "qwen3_0_6b", "qwen3"),
    ("recipe_gemma3_1b", "gemma3_1b", "gemma3")])
def test_recipe_experiments_need_only_a_path(experiment, model, family, compose, cache_dir):
    tiny_model = load_model(compose(tiny(family)).model, Cache(cache_dir))
    cfg = compose([f"+experiment={experiment}", f"model.path={tiny_model.hf_dir}", "eval.limit=2"])
    assert cfg.model.name == model and cfg.quant.name.startswith("recipe_")
    if experiment == "recipe_qwen3_0_6b":
        assert list(cfg.algorithm) == ["seq_mse"] and cfg.algorithm.seq_mse.candidates == 50  # as upstream runs it
    validate(cfg)


def test_an_override_selecting_no_layer_is_refused_before_work(compose):
    cfg = compose(TINY + ["quant=16a4w", "quant.overrides=[{pattern: 'feed_forward\\.w9_conv', scheme: 16a8w}]"])
    with pytest.raises(ConfigError, match=r"matches no weight layer of this model.*layers\.N\.feed_forward\.w2_conv"):
        validate(cfg)
    assert static_module_path("layers.0.feed_forward.w2.weight") == "layers.0.feed_forward.w2_conv"


def test_an_override_that_is_not_a_regex_names_itself_before_work(compose):
    cfg = compose(TINY + ["quant=16a4w", "quant.overrides=[{pattern: 'output\\.conv', scheme: 16a8w}, "
                                         "{pattern: '(', scheme: 16a8w}]"])
    with pytest.raises(ConfigError, match=r"quant.overrides\[1\] pattern '\(' is not a valid regex .*position 0"):
        validate(cfg)


def test_shipped_gemma_has_its_lm_head_before_loading(compose):
    """Gemma-3-270m's GGUF has no `gemma3.vocab_size` and ties its lm head to the embedding: the metadata shapes
    still list the lm head (vocabulary from the token list), so the recipes' lm-head override validates."""
    from qexp.models.shapes import linear_shapes

    cfg = compose(["model=gemma3_270m", "quant=16a4w_block", "quant.block_size=64", "backend=none"])
    assert linear_shapes(cfg.model)["output.weight"] == (262144, 640)
    validate(cfg)
