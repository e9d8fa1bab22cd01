"""Reading a Hugging Face config.json faithfully: every key is either understood by the family's converter or known
to leave a causal LM's forward pass unchanged; anything else is refused in one line, never ignored (a key the
converter skipped once made Llama-3.x models compute plain RoPE where transformers computes its scaled RoPE).

RoPE scaling is read from both places transformers has kept it: `rope_scaling` (transformers 4.x configs, as the
released checkpoints carry) and the flat `rope_parameters` of transformers 5.
"""

from __future__ import annotations

from typing import Iterable, Optional

from qexp.core.errors import InputError

# Keys of any family's config.json that do not change what the model computes for a sequence of tokens, or that
# qexp's loader reads itself (max_position_embeddings: the context check; vocab_size and the shape keys: every
# family's params).
NEUTRAL_KEYS = frozenset({
    "architectures", "model_type", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    "cache_implementation", "max_position_embeddings", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "head_dim",
})

# Any token id (unk_token_id, sep_token_id, ...; a GGUF's folder carries unk_token_id) and the name a folder was
# saved from (a GGUF's `_model_name_or_path`)
NEUTRAL_SUFFIXES = ("_token_id", "name_or_path")

# Llama 3.1 / 3.2's RoPE scaling as ExecuTorch's static llama computes it (executorch/examples/models/llama/rope.py
# apply_scaling: low_freq_factor 1 and an original context of 8192 fixed, high_freq_factor 4 by default); the
# factor is a ModelArgs field (rope_scale_factor).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_keys(c: dict, family: str, understood: Iterable[str]) -> None:
    """Refuse a config.json key that is neither neutral nor understood by `family`'s converter."""
    generic = _generic_defaults()
    unknown = sorted(k for k in set(c) - NEUTRAL_KEYS - set(understood)
                     if not (_generic_default(k, c[k], generic) or k.endswith(NEUTRAL_SUFFIXES)))
    if unknown:
        raise InputError(f"{family}: config.json keys qexp's converter does not understand: {', '.join(unknown)}",
                         "qexp refuses rather than ignores them; remove a key that does not change the model, or "
                         "open an issue for the feature it describes")


def require(c: dict, family: str, key: str, allowed: tuple, why: str) -> None:
    """A key qexp understands only at some values (e.g. mlp_bias=false)."""
    if key in c and c[key] not in allowed:
        raise InputError(f"{family}: {key}={c[key]!r} is not supported", why)


def rope_scaling(c: dict) -> Optional[dict]:
    """The config's RoPE scaling as one dict with `rope_type` (None for plain RoPE)."""
    scaling = c.get("rope_scaling")
    if not scaling:
        flat = c.get("rope_parameters") or {}
        # transformers 5 flat form ({"rope_type": ..., "rope_theta": ...}); Gemma's per-layer-type form is the
        # Gemma converter's to read
        scaling = flat if "rope_type" in flat or "type" in flat else {}
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type in (None, "default"):
        return None
    return {"rope_type": rope_type, **scaling}


def llama3_rope_params(c: dict, family: str) -> dict:
    """ModelArgs switches for the config's RoPE: plain, or Llama 3's scaling with the constants upstream fixes;
    any other scaling (yarn, linear, dynamic, longrope) is refused."""
    scaling = rope_scaling(c)
    if scaling is None:
        return {"use_scaled_rope": False}
    if scaling["rope_type"] != "llama3":
        raise InputError(f"{family}: RoPE scaling {scaling['rope_type']!r} is not supported",
                         "ExecuTorch's static llama computes plain RoPE and Llama 3's scaling (rope_type llama3) only")
    for key, value in LLAMA3_FIXED.items():
        if float(scaling.get(key, value)) != value:
            raise InputError(f"{family}: Llama 3 RoPE scaling with {key}={scaling[key]} is not supported",
                             f"ExecuTorch's static llama fixes {key}={value:g} (the Llama 3.1/3.2 value)")
    extra = sorted(set(scaling) - set(LLAMA3_FIXED) - {"rope_type", "factor", "rope_theta"})
    if extra:
        raise InputError(f"{family}: Llama 3 RoPE scaling keys qexp does not understand: {', '.join(extra)}",
                         "qexp refuses rather than ignores them")
    return {"use_scaled_rope": True, "rope_scale_factor": float(scaling["factor"])}


def _generic_defaults() -> dict:
    """transformers' PretrainedConfig attributes at their defaults (a config saved in full lists them all)."""
    from transformers import PretrainedConfig

    return PretrainedConfig().to_dict()


def _generic_default(key: str, value, generic: dict) -> bool:
    """A PretrainedConfig attribute at its default, or one that only a classification head reads."""
    return key in ("id2label", "label2id", "problem_type", "num_labels") or (key in generic and value == generic[key])
