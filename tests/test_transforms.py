"""The model-transform seam: a transform of the loaded float model reaches every later stage, including the programs
the HTP and XNNPACK backends rebuild for deployment, extends the fingerprint (cache keys), and leaves the FP phase
(the reference) untouched.

Two test transforms, registered here:
- `test_permute_vocab` permutes the rows of the output projection: it changes the function in a way nobody can miss
  (the argmax token moves), so a program built from the untransformed model would disagree with the QDQ phase;
- `test_rescale_norm` scales the final norm's weight by `factor` and the output projection by 1/factor: it keeps
  the function, so `ppl_fp_transformed` must equal `ppl_fp`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from helpers import TINY
from qexp.core.errors import ConfigError
from qexp.pipeline import run_experiment, validate
from qexp.transforms import ModelTransform, TransformConfig, register_transform


@dataclass
class PermuteConfig(TransformConfig):
    seed: int = 0


@register_transform
class PermuteVocab(ModelTransform):
    name = "test_permute_vocab"
    config_class = PermuteConfig

    def apply(self, model, context):
        generator = torch.Generator().manual_seed(self.config.seed)
        perm = torch.randperm(model.params["vocab_size"], generator=generator)
        state = dict(model.state_dict, **{"output.weight": model.state_dict["output.weight"][perm].clone()})
        return dataclasses.replace(model, state_dict=state)


@dataclass
class RescaleConfig(TransformConfig):
    factor: float = 4.0


@register_transform
class RescaleNorm(ModelTransform):
    name = "test_rescale_norm"
    config_class = RescaleConfig

    def apply(self, model, context):
        f = self.config.factor
        state = dict(model.state_dict)
        state["norm.weight"] = state["norm.weight"] * f
        state["output.weight"] = state["output.weight"] / f
        return dataclasses.replace(model, state_dict=state)


PERMUTE = ["+algorithm.test_permute_vocab={seed: 1}"]


def test_function_preserving_transform_keeps_float_perplexity(compose):
    result = run_experiment(compose(TINY + ["quant=16a8w", "+algorithm.test_rescale_norm={factor: 4.0}"]))
    m, tags = result.metrics, result.tags
    assert abs(m["ppl_fp_transformed_vs_fp"]) < 1e-4, m["ppl_fp_transformed_vs_fp"]
    assert tags["algorithm"] == "test_rescale_norm" and tags["model_sha256_transformed"] != tags["model_sha256"]


def test_transformed_float_evaluation_is_read_back(compose):
    """`ppl_fp_transformed` is evaluated once per transformed model and windows (a sweep over schemes, a rerun with
    another backend), and the read-back gives the same numbers."""
    cfg = compose(TINY + ["quant=16a8w", "+algorithm.test_rescale_norm={factor: 3.0}"])
    first, second = run_experiment(cfg), run_experiment(cfg)
    assert first.tags["fp_transformed_eval_cache_hit"] == "false"
    assert second.tags["fp_transformed_eval_cache_hit"] == "true"
    for name in ("ppl_fp_transformed", "ppl_fp_transformed_vs_fp", "top1_agreement_fp_transformed_vs_fp"):
        assert second.metrics[name] == first.metrics[name], name


def test_transform_reaches_qdq_and_the_htp_program(compose):
    plain = run_experiment(compose(TINY + ["quant=16a8w"]))
    cfg = compose(TINY + ["quant=16a8w", "backend=htp", "backend.prefill_ar_len=16", "backend.eval_tokens=64",
                          "backend.bench.prompt_len=8", "backend.bench.repeats=1"] + PERMUTE)
    result = run_experiment(cfg)
    m, tags = result.metrics, result.tags
    # the FP phase is the untransformed reference: same numbers as without the transform
    assert m["ppl_fp"] == plain.metrics["ppl_fp"]
    # QDQ and the compiled .pte both come from the permuted model: they agree with each other, not with FP
    assert m["top1_agreement_qdq_vs_fp"] < 0.2
    assert m["top1_agreement_deployed_vs_qdq"] > 0.9 and m["top1_agreement_deployed_vs_fp"] < 0.2
    # the fingerprint carries the transform into every cache key
    assert tags["qdq_cache_key"] != plain.tags["qdq_cache_key"]


def test_transform_reaches_the_xnnpack_program(compose):
    cfg = compose(TINY + ["quant=fp32", "backend=xnnpack", "backend.qmode=fp32", "backend.bench.new_tokens=4",
                          "backend.bench.repeats=1", "backend.bench.warmup=0"] + PERMUTE)
    m = run_experiment(cfg).metrics
    # an fp32 export of the permuted model: the untransformed FP phase's argmax is elsewhere
    assert m["top1_agreement_deployed_vs_fp"] < 0.2
    assert m["ppl_deployed"] == pytest.approx(m["ppl_fp_transformed"], rel=1e-4)


def test_bad_transform_settings_are_rejected_before_work(compose):
    with pytest.raises(ConfigError, match="test_permute_vocab"):
        validate(compose(TINY + ["+algorithm.test_permute_vocab={seeds: 1}"]))
