"""Config composition: every group value and experiment composes; wrong values are rejected with the valid ones."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ValidationError

from helpers import CONF
from qexp.core.config import SCHEMES
from qexp.core.errors import ConfigError
from qexp.pipeline import validate

GROUPS = ["model", "quant", "observer", "calibration", "eval", "text", "backend", "algorithm", "tracking", "experiment"]


def test_groups_exist():
    for group in GROUPS:
        assert (CONF / group).is_dir(), group
    assert {p.stem for p in (CONF / "quant").glob("*.yaml")} >= set(SCHEMES) | {"fp32"}
    assert {p.stem for p in (CONF / "model").glob("*.yaml")} >= {
        "smollm2_135m", "tiny", "llama_checkpoint", "hf", "stories110m", "llama3_2_1b"}
    assert {p.stem for p in (CONF / "experiment").glob("*.yaml")} >= {
        "16a4w_wikitext", "8a8w_wikitext", "16a8w_wikitext", "fp32_wikitext"}


def test_default_config(compose):
    cfg = compose()
    assert cfg.model.name == "smollm2_135m" and cfg.quant.scheme == "16a4w" and cfg.backend.name == "none"
    assert cfg.export.max_context_len == cfg.eval.seq_len == cfg.calibration.seq_len
    validate(cfg)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(compose, experiment):
    cfg = compose([f"+experiment={experiment}"])
    if experiment.startswith("recipe_"):  # upstream's per-model recipes (tests/test_recipes.py checks the grids)
        model = experiment.removeprefix("recipe_")
        assert cfg.model.name == model and cfg.quant.name in ("16a8w", f"recipe_{model}", "recipe_gemma3_1b")
        if model in ("smollm2_135m", "gemma3_270m"):  # shipped; the others need a path (test_recipes gives one)
            validate(cfg)
        return
    if cfg.algorithm:  # algorithm presets are named after the seed's rows (awq_w4_g64, ...), not a scheme
        validate(cfg)
        return
    scheme = experiment.replace("_wikitext", "")
    if scheme.endswith("_lookahead"):
        scheme = scheme.removesuffix("_lookahead")
        assert cfg.backend.model_mode.value == "lookahead"
    if scheme.startswith("xnnpack_"):  # CPU deployment: the scheme is the XNNPACK qmode, the QNN group stays fp32
        assert cfg.quant.name == "fp32" and cfg.backend.name == "xnnpack"
        assert cfg.backend.qmode == scheme.removeprefix("xnnpack_")
    else:
        assert cfg.quant.name == scheme
        assert cfg.backend.name == ("none" if scheme == "fp32" else "htp")  # all phases the scheme allows
    validate(cfg)


@pytest.mark.parametrize("group", ["quant", "observer", "calibration", "backend", "model"])
def test_every_group_value_composes(compose, group):
    # nested folders too: conf/quant/mixed/ holds recipes the sensitivity analysis wrote (quant=mixed/<name>)
    for path in sorted((CONF / group).rglob("*.yaml")):
        option = path.relative_to(CONF / group).with_suffix("").as_posix()
        cfg = compose([f"{group}={option}"])
        assert cfg[group].name == path.stem


def test_q4_0_gap_variants_compose_beside_their_sweep(compose):
    """sweeps/q4_0_gap.yaml sweeps the group sweep/q4_0_gap (sweeps/q4_0_gap/, `# @package _global_`): each variant
    composes with the sweep and sets what its name says on top of 16a4w_block."""
    from omegaconf import OmegaConf

    grid = OmegaConf.load(CONF / "sweep" / "q4_0_gap.yaml").hydra.sweeper.params
    expected = {  # block scale rounding, weight range, KV-cache annotation
        "base": ("nearest", "narrow", ["annotate_kv_8bit"]),
        "block_scales_float": ("float", "narrow", ["annotate_kv_8bit"]),
        "full_range": ("nearest", "full", ["annotate_kv_8bit"]),
        "kv16": ("nearest", "narrow", []),
        "all": ("float", "full", []),
    }
    assert grid["+sweep/q4_0_gap"].split(",") == list(expected)
    assert {p.stem for p in (CONF / "sweep" / "q4_0_gap").glob("*.yaml")} == set(expected)
    for variant, settings in expected.items():
        cfg = compose(["+sweep=q4_0_gap", f"+sweep/q4_0_gap={variant}"], tracked=False)
        quant = cfg.quant
        got = (quant.block_scale_rounding.name, quant.weight_range.name, list(quant.custom_annotations))
        assert (quant.name, cfg.backend.name, got) == ("16a4w_block", "none", settings), variant


def test_unknown_group_value_lists_options(compose):
    with pytest.raises(MissingConfigException) as err:
        compose(["quant=16a5w"])
    assert "16a4w" in str(err.value) and "8a8w" in str(err.value)  # Hydra lists the available options


def test_wrong_enum_value_lists_valid_values(compose):
    with pytest.raises(ConfigCompositionException) as err:
        compose(["observer.kind=median"])
    cause = err.value.__cause__
    assert isinstance(cause, ValidationError)
    assert "minmax" in str(cause) and "moving_average" in str(cause)


def test_wrong_type_rejected(compose):
    with pytest.raises(ConfigCompositionException):
        compose(["eval.seq_len=long"])


def test_misspelt_key_rejected(compose):
    with pytest.raises(ConfigCompositionException):
        compose(["quant.shceme=8a8w"])


def test_unknown_scheme_rejected_with_list(compose):
    cfg = compose(["quant.scheme=16a5w"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "16a5w" in str(err.value) and all(s in str(err.value) for s in SCHEMES)


def test_unknown_custom_annotation_rejected(compose):
    cfg = compose(["quant.custom_annotations=[annotate_everything]"])
    with pytest.raises(ConfigError, match="annotate_kv_8bit"):
        validate(cfg)


def test_unknown_arch_rejected(compose):
    with pytest.raises(ConfigError, match="smollm2_135m"):
        validate(compose(["model.arch=gpt5"]))


def test_window_longer_than_graph_context_rejected(compose):
    with pytest.raises(ConfigError, match="max_context_len"):
        validate(compose(["eval.seq_len=512", "export.max_context_len=256"]))


def test_each_backend_has_its_own_config(compose):
    """HTP's settings are not XNNPACK's: each backend's dataclass is the schema of its group file."""
    from omegaconf import OmegaConf

    from qexp.backends import BACKENDS

    for name, backend in BACKENDS.items():
        cfg = compose([f"backend={name}"])
        assert OmegaConf.get_type(cfg.backend) is backend.config_class
    assert compose(["backend=htp", "backend.kv_update=shift_pointer"]).backend.bench.new_tokens == 4
    assert compose(["backend=xnnpack"]).backend.bench.new_tokens == 64
    for wrong in (["backend=xnnpack", "backend.soc=SM8650"], ["backend=htp", "backend.qmode=8da4w"],
                  ["backend=none", "backend.kv_update=smart_mask"], ["backend=htp", "backend.kv_update=sideways"]):
        with pytest.raises(ConfigCompositionException):
            compose(wrong)


def test_unknown_backend_and_algorithm_list_the_known_ones(compose):
    from qexp.backends import get_backend

    with pytest.raises(ConfigError, match="htp.*none.*xnnpack"):
        get_backend("tpu")
    with pytest.raises(ConfigError, match="unknown algorithm 'quip'.*awq, gptq, qat, rotation, seq_mse, smoothquant"):
        validate(compose(["+algorithm.quip={w_bit: 4}"]))


# Everything a config can get wrong that validate() knows without the model, with what the message must name.
# validate() loads no model, so each of these is refused in milliseconds, before any heavy work.
BAD_CONFIGS = [
    (["eval.limit=0"], "eval.limit=0"),
    (["calibration.limit=0"], "calibration data is empty"),
    (["eval.seq_len=512", "export.max_context_len=256"], "exceeds the static graph context"),
    (["calibration.seq_len=512", "export.max_context_len=256"], "calibration.seq_len=512"),
    (["cache.max_gb=0"], "cache.max_gb=0"),
    (["observer=moving_average", "observer.averaging_constant=0"], "averaging_constant"),
    (["observer=percentile", "observer.percentile=10"], "use a value in (50, 100]"),
    (["quant=16a4w_block", "quant.block_size=0"], "use a positive block size"),
    # block sizes against the layers' shapes, read from the model's metadata (the GGUF header, the tiny spec)
    (["quant=16a4w_block", "quant.block_size=128"], "does not divide the 576 input channels"),
    (["model=tiny", "quant=16a4w_block", "quant.block_size=48"], "does not divide the 64 input channels"),
    (["quant=16a4w", "quant.weight_granularity=per_block"], "needs a block scheme"),
    (["quant=16a3w", "backend=htp"], "QDQ-only research scheme"),
    (["quant=16a4w", "quant.weight_range=full", "backend=htp"], "QDQ-only ablation"),
    (["quant=16a4w_block", "quant.weight_range=full", "algorithm=[awq]"], "algorithms search the [-7, 7] grid"),
    (["quant=16a8w", "quant.weight_range=full"], "the full [-8, 7] range is for 4-bit weights"),
    (["quant=fp32", "backend=htp"], "needs a quantized scheme"),
    (["quant=16a4w_block", "quant.block_size=64", "backend=htp"], "block_size=64"),
    (["backend=htp", "backend.max_seq_len=128"], "differs from export.max_context_len"),
    (["backend=htp", "backend.prefill_ar_len=0"], "use 1 <= prefill_ar_len < max_seq_len"),
    (["backend=htp", "backend.prefill_ar_len=256"], "use 1 <= prefill_ar_len < max_seq_len"),
    (["backend=htp", "backend.model_mode=lookahead", "backend.ngram=1"], "lookahead needs ngram >= 2"),
    (["backend=htp", "backend.model_mode=lookahead", "backend.window=64"], "not less than max_seq_len"),
    (["backend=htp", "backend.bench.prompt_len=254"], "does not fit the decode graph's cache"),
    (["algorithm=[smoothquant]", "quant=16a4w"], "smoothquant"),
    (["algorithm=[gptq]", "quant=fp32"], "gptq"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_every_bad_config_is_refused_before_work_in_one_line(compose, overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose(overrides))
    text = str(error.value)
    assert message in text and "\n" not in text, text
