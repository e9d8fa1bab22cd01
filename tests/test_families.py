"""Model families beyond Llama: tiny random Qwen2 (q/k/v biases) and Qwen3 (q/k norm, head_dim != dim / n_heads) go
through their family's converter and ExecuTorch's static llama, agree with transformers, and quantize; the Qwen
presets need only model.path; an unsupported architecture is one clear error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import TINY
from qexp.cache import Cache, stable_hash
from qexp.data.windows import make_windows
from qexp.errors import InputError
from qexp.eval.perplexity import evaluate
from qexp.models.sources import load_model
from qexp.models.static_llama import StaticLlama, window_logits

FAMILIES = ("qwen2", "qwen3")


def tiny(family: str) -> list:
    """The TINY overrides with the tiny model of `family` (conf/model/tiny_<family>.yaml)."""
    return [f"model=tiny_{family}" if o == "model=tiny" else o for o in TINY]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, compose, cache_dir):
    return request.param, load_model(compose(tiny(request.param)).model, Cache(cache_dir))


def test_tiny_qwen_models_have_their_family_features(family_model):
    family, model = family_model
    assert model.hf_rope_layout and model.params["use_hf_rope"]
    assert model.state_dict["output.weight"] is model.state_dict["tok_embeddings.weight"]  # tied, as the 0.5B/0.6B
    if family == "qwen2":
        assert model.params["attention_qkv_bias"] and "layers.1.attention.wk.bias" in model.state_dict
    else:
        assert model.params["use_qk_norm"] and model.params["qk_norm_before_rope"] and model.params["head_dim"] == 32
        assert model.state_dict["layers.0.attention.wq.weight"].shape == (4 * 32, 64)
        assert "layers.1.attention.k_norm_fn.weight" in model.state_dict


def test_tiny_llama_key_is_unchanged(compose):
    """The tiny spec's new fields (family, head_dim) stay out of the llama's key: its cache entries and fingerprint."""
    from qexp.models.tiny import tiny_key

    assert stable_hash(tiny_key(compose(TINY).model.tiny)) == "898abb71c1d33238"
    assert "family" in tiny_key(compose(tiny("qwen3")).model.tiny)


def test_static_graph_perplexity_matches_transformers(family_model, corpus):
    """FP token perplexity of qexp's static llama equals transformers' on the same windows (within 0.1%)."""
    from transformers import AutoModelForCausalLM

    family, model = family_model
    windows = make_windows(corpus.joined("test"), model.tokenizer, 64, 3, model.add_bos)
    static = StaticLlama(model, 64)
    ours = evaluate(lambda ids: window_logits(static.module, static, ids), windows, "static").metrics()
    hf = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=torch.float32).eval()
    theirs = evaluate(lambda ids: hf(torch.as_tensor(ids, dtype=torch.long)[None]).logits[0], windows, "hf").metrics()
    print(f"{family}: ppl static {ours['ppl']:.6f} transformers {theirs['ppl']:.6f}")
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-3), (ours["ppl"], theirs["ppl"])
    assert 1 < ours["ppl"] < 10 * model.params["vocab_size"]


@pytest.mark.parametrize("quant", ["16a4w", "8a8w"])
@pytest.mark.parametrize("family", FAMILIES)
def test_qdq_run(family, quant, compose):
    from qexp.pipeline import run_experiment

    result = run_experiment(compose(tiny(family) + [f"quant={quant}"]))
    m = result.metrics
    print(f"{family} {quant}: ppl_fp {m['ppl_fp']:.4f} ppl_qdq {m['ppl_qdq']:.4f}")
    assert math.isfinite(m["ppl_fp"]) and math.isfinite(m["ppl_qdq"])
    assert m["ppl_qdq"] != m["ppl_fp"]  # quantization did something


@pytest.mark.parametrize("preset,family", [("qwen2_5_0_5b", "qwen2"), ("qwen3_0_6b", "qwen3")])
def test_qwen_presets_need_only_a_path(preset, family, compose, cache_dir):
    """The real-model presets load an HF folder of their family with model.path= alone (here the tiny one's)."""
    from qexp.pipeline import validate

    tiny_model = load_model(compose(tiny(family)).model, Cache(cache_dir))
    cfg = compose([f"model={preset}", f"model.path={tiny_model.hf_dir}"])
    validate(cfg)
    loaded = load_model(cfg.model, Cache(cache_dir))
    assert loaded.params == tiny_model.params and loaded.hf_rope_layout and not loaded.add_bos
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(tensor, loaded.state_dict[name]), name


def test_unsupported_architecture_is_one_line(tmp_path, compose, cache_dir):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError) as info:
        load_model(compose(["model=hf", f"model.path={tmp_path}"]).model, Cache(cache_dir))
    message = str(info.value)
    assert "\n" not in message and "architecture MistralForCausalLM is not supported" in message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


@pytest.mark.parametrize("change,match", [
    ({"use_sliding_window": True}, "sliding-window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
])
def test_qwen_features_the_static_llama_lacks_are_refused(family_model, change, match):
    from qexp.models.families import family_for_architecture

    family, model = family_model
    config = json.loads((Path(model.hf_dir) / "config.json").read_text())
    with pytest.raises(InputError, match=match):
        family_for_architecture(config["architectures"][0]).params_from_hf_config({**config, **change})


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_htp_compile_and_emulator_run(family, compose):
    """The tiny Qwen through the HTP backend (SM8650, hybrid: kv + AR-16 prefill graphs) on the x86 emulator agrees
    with its CPU QDQ program (qwen2 with R3 on, kept a matmul)."""
    from qexp.pipeline import run_experiment

    result = run_experiment(compose(tiny(family) + [
        "quant=16a8w", "backend=htp", "backend.prefill_ar_len=16", "backend.eval_tokens=64",
        "backend.eval_kv_tokens=12", "backend.bench.prompt_len=16", "backend.bench.new_tokens=4",
        "backend.bench.repeats=1", "backend.bench.warmup=0"]))
    m, tags = result.metrics, result.tags
    print(f"{family} htp: ppl_fp {m['ppl_fp']:.4f} ppl_qdq {m['ppl_qdq']:.4f} ppl_deployed {m['ppl_deployed']:.4f} "
          f"vs qdq {m['ppl_deployed_vs_qdq']:+.4f} top1 {m['top1_agreement_deployed_vs_qdq']:.3f}")
    assert tags["deployed_phase"] == "htp" and tags["target"] == "x86_emulator"
    assert abs(m["ppl_deployed_vs_qdq"]) < 0.03 and m["top1_agreement_deployed_vs_qdq"] > 0.7, m
