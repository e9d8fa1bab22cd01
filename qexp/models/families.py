"""Model families: how a source checkpoint of one architecture becomes qexp's model (Meta layout + params).

A family is looked up by the Hugging Face architecture name in a folder's config.json (GGUF files are read into
such a folder first), so adding one is one `Family` entry (here, or in a module of its own imported at the bottom,
as qexp/models/qwen.py) plus a conf/model/<preset>.yaml. Meta checkpoints are already in the common layout (family
`llama`). An architecture no family serves gets one line naming the supported ones.

What a family's layers need beyond a plain Llama decoder is declared as data, `Family.features` (names from
`FEATURES`), so that code reading shapes without loading weights (the HTP speed model counts an RMSNorm per q/k head
as single-head ops) asks the family instead of keeping its own list of architectures; the tests check that each
family's converted params say the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional, Tuple

import torch

from qexp.core.errors import InputError
from qexp.core.registry import Registry

StateDict = Dict[str, torch.Tensor]

# What a family's layers may need beyond a plain Llama decoder (the static llama's ModelArgs switch named after it).
FEATURES: Dict[str, str] = {
    "qkv_bias": "biases on the q, k and v projections (attention_qkv_bias)",
    "qk_norm": "an RMSNorm on each q and k head (use_qk_norm): one more single-head op per head on HTP",
    "sliding_window": "sliding-window attention layers beside global ones (layer_types): a second mask and RoPE table",
    "post_norms": "norms after attention and after the MLP as well as before (post_attention_norm, post_ffn_norm)",
    "gelu_mlp": "a GeGLU MLP with the tanh-approximated GELU (act_fn gelu_approx) instead of SwiGLU",
    "scaled_embedding": "input embeddings scaled by sqrt(dim) (embedding_scale_factor), folded into the table",
    "unit_offset_norm": "RMSNorm gains applied as (1 + w), folded into the gains at load",
}


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: Tuple[str, ...]  # config.json "architectures" values this family converts
    params_from_hf_config: Callable[[dict], dict]  # HF config.json -> Meta params.json content
    state_dict_from_hf: Callable[[StateDict, dict], StateDict]  # HF weights (+ params) -> Meta-layout weights
    # The converted q/k rows stay in HF's rotate-half order (upstream's transform_weight=False families) instead of
    # Meta's interleaved order, which the static llama permutes back (qexp/models/static_llama.py).
    hf_rope_layout: bool = False
    features: FrozenSet[str] = frozenset()  # names from FEATURES: what the layers need beyond a plain Llama decoder
    gguf_architectures: Tuple[str, ...] = ()  # GGUF `general.architecture` values of this family's checkpoints
    # The tiny random test model of the family (model=tiny model.tiny.family=<name>, qexp/models/tiny.py):
    # (TinyModelSpec, the HF config fields every family shares) -> (transformers model class, its config)
    tiny: Optional[Callable[[object, dict], tuple]] = None


FAMILIES: Registry[Family] = Registry("model family")


def register_family(family: Family) -> Family:
    unknown = sorted(set(family.features) - set(FEATURES))
    if unknown:
        raise ValueError(f"family {family.name}: unknown features {unknown}; known: {sorted(FEATURES)}")
    return FAMILIES.add(family.name, family)


def family_of_hf_architecture(architecture: str) -> Optional[Family]:
    """The family that converts a config.json architecture, None when none does."""
    return next((f for f in FAMILIES.values() if architecture in f.hf_architectures), None)


def family_for_architecture(architecture: str, where: str = "") -> Family:
    family = family_of_hf_architecture(architecture)
    if family is not None:
        return family
    supported = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise InputError(f"{where + ': ' if where else ''}architecture {architecture} is not supported",
                     f"qexp converts: {', '.join(supported)}")


def family_for_gguf_architecture(architecture: str) -> Optional[Family]:
    """The family of a GGUF file's `general.architecture`, None when no family declares it."""
    return next((f for f in FAMILIES.values() if architecture in f.gguf_architectures), None)


# ---------------------------------------------------------------- Llama (Llama 2/3.x, SmolLM2, ...)
# config.json keys the Llama converter reads beyond the neutral ones (qexp/models/hf_config.py), each at the values
# `llama_params` checks
LLAMA_KEYS = ("attention_bias", "mlp_bias", "hidden_act", "pretraining_tp")


def llama_params(c: dict, family: str = "llama", understood: tuple = LLAMA_KEYS) -> dict:
    """HF LlamaConfig -> Meta params. Every key is understood or refused (`understood`: the caller family's keys)."""
    from qexp.models.hf_config import check_keys, llama3_rope_params, require

    check_keys(c, family, understood)
    require(c, family, "mlp_bias", (False,), "the static llama's MLP has no biases")
    require(c, family, "hidden_act", ("silu",), "the static llama's MLP is SwiGLU (hidden_act silu)")
    require(c, family, "pretraining_tp", (1,), "transformers computes pretraining_tp > 1 as 1; re-save with 1")
    n_heads = c["num_attention_heads"]
    params = {
        "dim": c["hidden_size"],
        "n_layers": c["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": c.get("num_key_value_heads", n_heads),
        "vocab_size": c["vocab_size"],
        "hidden_dim": c["intermediate_size"],
        "norm_eps": c.get("rms_norm_eps", 1e-5),
        "rope_theta": float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        **llama3_rope_params(c, family),  # Llama 3.1/3.2's scaled RoPE (rope_type llama3), else plain
        "use_hf_rope": False,
        "attention_qkv_bias": bool(c.get("attention_bias", False)),
    }
    head_dim = c.get("head_dim")
    if head_dim and head_dim != c["hidden_size"] // n_heads:
        params["head_dim"] = head_dim
    return params


_LLAMA_HF_TO_META = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
}


def llama_state_dict(sd: StateDict, params: dict) -> StateDict:
    """HF Llama names and rotate-half q/k layout -> Meta names and interleaved layout (as torchtune converts)."""
    dim, n_heads, n_kv = params["dim"], params["n_heads"], params["n_kv_heads"]
    head_dim = params.get("head_dim", dim // n_heads)

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)

    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    for i in range(params["n_layers"]):
        for hf_name, meta_name in _LLAMA_HF_TO_META.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                w = unpermute(w, n_heads)
            elif hf_name == "self_attn.k_proj":
                w = unpermute(w, n_kv)
            out[f"layers.{i}.{meta_name}.weight"] = w
    out["output.weight"] = sd.get("lm_head.weight", out["tok_embeddings.weight"])  # tied embeddings
    return {k: v.float().contiguous() for k, v in out.items()}


def tiny_llama(spec, common: dict) -> tuple:
    import transformers

    config = transformers.LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM, config


LLAMA = register_family(Family("llama", ("LlamaForCausalLM",), llama_params, llama_state_dict,
                               gguf_architectures=("llama",), tiny=tiny_llama))

