"""The configs of the models people ship, converted faithfully: each released config.json qexp carries
(qexp/models/released/: Llama-3.2-1B/3B, Qwen2.5-0.5B/1.5B, Qwen3-0.6B/1.7B, Gemma-3-1B) with random weights, every
key as released (Llama 3's RoPE scaling, tied embeddings, GQA, q/k norms, sliding windows longer than the windows)
and its first layers, scores transformers' FP perplexity to 1e-6 relative and its logits to 1e-4 through qexp's
converter and ExecuTorch's static llama. A key the converter does not understand is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from qexp.cache import Cache
from qexp.core.errors import InputError

RELEASED = ("llama3_2_1b", "llama3_2_3b", "qwen2_5_0_5b", "qwen2_5_1_5b", "qwen3_0_6b", "qwen3_1_7b", "gemma3_1b")


def released_overrides(name: str, n_layers: int) -> list:
    """model=tiny overrides for the released config `name` with its first `n_layers` layers."""
    from qexp.models.families import family_for_architecture
    from qexp.models.tiny import released_config

    c = released_config(name)
    family = family_for_architecture(c["architectures"][0]).name
    return ["model=tiny", f"model.tiny.config={name}", f"model.tiny.family={family}", f"model.tiny.n_layers={n_layers}",
            f"model.tiny.dim={c['hidden_size']}", f"model.tiny.n_heads={c['num_attention_heads']}",
            f"model.tiny.n_kv_heads={c['num_key_value_heads']}", f"model.tiny.hidden_dim={c['intermediate_size']}",
            f"model.tiny.vocab_size={c['vocab_size']}",
            f"model.tiny.max_position_embeddings={c['max_position_embeddings']}",
            f"model.add_bos={str(family == 'gemma3').lower()}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RELEASED)
def test_released_config_scores_transformers_perplexity(name, compose, cache_dir, corpus):
    from transformers import AutoModelForCausalLM

    from qexp.data.windows import make_windows
    from qexp.eval.perplexity import evaluate
    from qexp.models.sources import load_model
    from qexp.models.static_llama import StaticLlama, window_logits

    # Gemma's pattern puts its first global layer sixth; two layers are enough elsewhere
    model = load_model(compose(released_overrides(name, 6 if name.startswith("gemma") else 2)).model,
                       Cache(cache_dir))
    if name.startswith("llama"):
        assert model.params["use_scaled_rope"] and model.params["rope_scale_factor"] == 32.0
    windows = make_windows(corpus.joined("test"), model.tokenizer, 128, 2, model.add_bos)
    hf = AutoModelForCausalLM.from_pretrained(model.hf_dir, dtype=torch.float32).eval()
    hf_logits = {}

    def theirs_fn(ids):
        hf_logits[len(hf_logits)] = out = hf(torch.as_tensor(ids, dtype=torch.long)[None]).logits[0]
        return out

    theirs = evaluate(theirs_fn, windows, "hf").metrics()["ppl"]
    static = StaticLlama(model, 128)
    ours_logits = {}

    def ours_fn(ids):
        ours_logits[len(ours_logits)] = out = window_logits(static.module, static, ids)
        return out

    ours = evaluate(ours_fn, windows, "static").metrics()["ppl"]
    worst = max(float((ours_logits[i] - hf_logits[i]).abs().max()) for i in hf_logits)
    print(f"{name}: ppl static {ours:.8f} transformers {theirs:.8f} ({ours / theirs - 1:+.2e}); "
          f"max |logit diff| {worst:.2e}")
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert worst < 1e-4


@pytest.mark.parametrize("name", RELEASED)
def test_every_key_of_a_released_config_is_understood(name):
    """Both forms: as released (transformers 4.x `rope_scaling`) and as transformers 5 saves it (`rope_parameters`)."""
    import transformers

    from qexp.models.families import family_for_architecture
    from qexp.models.tiny import released_config

    c = released_config(name)
    family = family_for_architecture(c["architectures"][0])
    released = family.params_from_hf_config(c)
    saved = transformers.AutoConfig.for_model(c["model_type"], **{k: v for k, v in c.items() if k != "model_type"})
    resaved = family.params_from_hf_config(json.loads(saved.to_json_string(use_diff=False)))
    for key in ("use_scaled_rope", "rope_scale_factor", "rope_theta", "n_kv_heads", "head_dim", "layer_types"):
        assert released.get(key) == resaved.get(key), key
    assert released["use_scaled_rope"] == name.startswith("llama")


@pytest.mark.parametrize("name,change,match", [
    ("llama3_2_1b", {"attn_temperature_tuning": True}, "keys qexp's converter does not understand: attn_temperature"),
    ("llama3_2_1b", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    ("llama3_2_1b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ("llama3_2_1b", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "low_freq_factor=2.0"),
    ("qwen2_5_0_5b", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "RoPE scaling 'yarn'"),
    ("qwen3_0_6b", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("gemma3_1b", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "RoPE scaling"),
])
def test_a_config_key_the_converter_does_not_understand_is_refused(name, change, match):
    from qexp.models.families import family_for_architecture
    from qexp.models.tiny import released_config

    c = released_config(name)
    with pytest.raises(InputError, match=match) as info:
        family_for_architecture(c["architectures"][0]).params_from_hf_config({**c, **change})
    assert "\n" not in str(info.value)


def test_the_keys_a_gguf_folder_and_transformers_5_write_are_understood():
    """SmolLM2's folder as transformers 5 writes it from the shipped GGUF (its name, unk_token_id, rope_parameters):
    every key understood, nothing refused."""
    from qexp.models.families import LLAMA

    smollm2 = {"_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "architectures": ["LlamaForCausalLM"],
               "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "float32",
               "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.02,
               "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama",
               "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
               "pretraining_tp": 1, "rms_norm_eps": 9.999999747378752e-06,
               "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
               "transformers_version": "5.23.0", "unk_token_id": 0, "use_cache": True, "vocab_size": 49152}
    params = LLAMA.params_from_hf_config(smollm2)
    assert not params["use_scaled_rope"] and params["rope_theta"] == 100000.0
