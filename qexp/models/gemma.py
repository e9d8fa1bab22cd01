"""The Gemma 3 family (text models: Gemma-3-270m, Gemma-3-1b): sliding-window and global attention layers, RMSNorm on
each q/k head, pre- and post-norms around attention and the MLP, GeGLU (tanh-approximated GELU), embeddings scaled
by sqrt(dim), `(1 + w)` RMSNorm gains, tied output.

ExecuTorch's static llama runs it as `MultiScopeAwareLlamaModel` (a second RoPE table with the local theta and a
second, sliding-window attention mask for the sliding layers), chosen by qexp/models/static_llama.py when the params
hold `layer_types`. Names are mapped by ExecuTorch's own converter (`gemma3_to_executorch`); like upstream's loader
(llm_wrappers.py) qexp then folds Gemma's `(1 + w)` into every norm gain and sqrt(dim) into the input embedding only
(the tied output keeps the unscaled table), so the static llama's plain RMSNorm and embedding compute Gemma's
function. q/k rows stay in Hugging Face's rotate-half order (upstream: transform_weight=False).
Registered by qexp/models/families.py.
"""

from __future__ import annotations

import math

from qexp.core.errors import InputError
from qexp.models.families import Family, StateDict, register_family

_GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)  # upstream's act_fn "gelu_approx"


def _rope_thetas(c: dict) -> tuple:
    """(global theta, local theta): transformers >= 5 nests them per layer type in rope_parameters; older configs
    have rope_theta / rope_local_base_freq."""
    per_type = c.get("rope_parameters") or {}
    for layer_type, entry in per_type.items():
        if isinstance(entry, dict) and entry.get("rope_type", "default") != "default":
            raise InputError(f"gemma3: RoPE scaling {entry['rope_type']!r} on {layer_type} layers is not supported",
                             "qexp supports plain RoPE only (the 270m and 1b text models have it)")
    full = (per_type.get("full_attention") or {}).get("rope_theta", c.get("rope_theta", 1e6))
    local = (per_type.get("sliding_attention") or {}).get("rope_theta", c.get("rope_local_base_freq", 1e4))
    return float(full), float(local)


# config.json keys the Gemma 3 converter reads beyond the neutral ones (qexp/models/hf_config.py), each at the values
# `gemma3_params` checks
GEMMA3_KEYS = ("attention_bias", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
               "query_pre_attn_scalar", "use_bidirectional_attention", "layer_types", "sliding_window",
               "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq")


def gemma3_params(c: dict) -> dict:
    """HF Gemma3TextConfig -> upstream ModelArgs fields (those of its gemma3/config/1b_config.json)."""
    from qexp.models.hf_config import check_keys, require

    check_keys(c, "gemma3", GEMMA3_KEYS)
    require(c, "gemma3", "attention_bias", (False,), "the static llama's Gemma attention has no biases")
    if c.get("rope_scaling"):
        raise InputError(f"gemma3: RoPE scaling {c['rope_scaling']} is not supported",
                         "qexp supports plain RoPE only (the 270m and 1b text models have it)")
    head_dim = c.get("head_dim", 256)
    unsupported = {
        "attn_logit_softcapping": c.get("attn_logit_softcapping"),
        "final_logit_softcapping": c.get("final_logit_softcapping"),
    }
    for name, value in unsupported.items():
        if value is not None:
            raise InputError(f"gemma3: {name}={value} is not supported", "Gemma 3 text models have none (Gemma 2 does)")
    if c.get("hidden_activation", "gelu_pytorch_tanh") not in _GEMMA3_ACTIVATIONS:
        raise InputError(f"gemma3: hidden_activation={c.get('hidden_activation')!r} is not supported",
                         "the static llama has the tanh-approximated GELU only (gelu_pytorch_tanh)")
    if c.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise InputError(f"gemma3: query_pre_attn_scalar={c['query_pre_attn_scalar']} != head_dim={head_dim}",
                         "the static llama scales attention by 1/sqrt(head_dim)")
    if c.get("use_bidirectional_attention"):
        raise InputError("gemma3: bidirectional attention is not supported", "use a causal (text generation) model")
    n_layers = c["num_hidden_layers"]
    layer_types = c.get("layer_types") or [
        "full_attention" if (i + 1) % c.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    full_theta, local_theta = _rope_thetas(c)
    return {
        "dim": c["hidden_size"],
        "n_layers": n_layers,
        "n_heads": c["num_attention_heads"],
        "n_kv_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
        "head_dim": head_dim,
        "hidden_dim": c["intermediate_size"],
        "vocab_size": c["vocab_size"],
        "norm_eps": c.get("rms_norm_eps", 1e-6),
        "rope_theta": full_theta,
        "local_rope_theta": local_theta,
        "use_hf_rope": True,
        "use_scaled_rope": False,
        "attention_qkv_bias": False,
        "use_qk_norm": True,
        "qk_norm_before_rope": True,
        "post_attention_norm": True,
        "post_ffn_norm": True,
        "act_fn": "gelu_approx",
        "norm_type": "rmsnorm",  # (1 + w) is folded into the gains below, as upstream forces for its Gemma models
        "embedding_scale_factor": math.sqrt(c["hidden_size"]),
        "layer_types": list(layer_types),
        "sliding_window": int(c.get("sliding_window", 512)),
    }


def gemma3_state_dict(sd: StateDict, params: dict) -> StateDict:
    """Upstream's gemma3_to_executorch, then upstream's load-time folding: every norm gain + 1, the input embedding
    times sqrt(dim) (in fp32, as transformers' Gemma3TextScaledWordEmbedding multiplies), the output unscaled."""
    from qexp import upstream

    sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied: the output is the embedding table
    try:
        out = upstream.gemma3_to_executorch(sd)
    except Exception as exc:  # noqa: BLE001 - upstream's get_mapped_key raises a bare Exception on unknown names
        raise InputError(f"gemma3: cannot convert the weights ({str(exc).splitlines()[0][:200]})",
                         "the folder's weights are not a plain Gemma 3 text checkpoint") from exc
    out = {k: v.float() for k, v in out.items()}
    for key in list(out):
        if "norm" in key:
            out[key] = out[key] + 1.0
    out["output.weight"] = out["tok_embeddings.weight"].clone()
    out["tok_embeddings.weight"] = out["tok_embeddings.weight"] * params["embedding_scale_factor"]
    return {k: v.contiguous() for k, v in out.items()}


def tiny_gemma3(spec, common: dict) -> tuple:
    """As Gemma-3-270m (global RoPE theta 1e6, local 1e4, eps 1e-6, tied, tanh GELU), with every layer but the last a
    sliding-window one and a window of 32 tokens, so that evaluation windows longer than 32 exercise the window
    mask."""
    import transformers

    head_dim = spec.head_dim or spec.dim // spec.n_heads
    config = transformers.Gemma3TextConfig(
        **dict(common, bos_token_id=1, eos_token_id=2, pad_token_id=0), head_dim=head_dim,
        query_pre_attn_scalar=head_dim, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=32,
        layer_types=["sliding_attention"] * (spec.n_layers - 1) + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
    )
    return transformers.Gemma3ForCausalLM, config


GEMMA3 = register_family(Family(
    "gemma3", ("Gemma3ForCausalLM",), gemma3_params, gemma3_state_dict, hf_rope_layout=True,
    features=frozenset({"qk_norm", "sliding_window", "post_norms", "gelu_mlp", "scaled_embedding", "unit_offset_norm"}),
    gguf_architectures=("gemma3",), tiny=tiny_gemma3,
))
