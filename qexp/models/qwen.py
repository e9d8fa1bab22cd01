"""The Qwen families: Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (RMSNorm on each q/k head before RoPE).

Both keep Hugging Face's q/k row order (rotate-half RoPE): upstream registers them with transform_weight=False and
converts them without any q/k permutation, so their models are `LoadedModel(hf_rope_layout=True)` and the static
llama uses the rows as they are (Llama's converter instead goes to Meta's interleaved order, which the static llama
permutes back). Names are mapped by ExecuTorch's own converters (qexp/upstream): `qwen_3_tune_to_meta` for Qwen3,
the mapping of `qwen_2_5_hf_to_meta` for Qwen2 (its function needs torchtune). Registered by qexp/models/families.py.
"""

from __future__ import annotations

from qexp.core.errors import ConfigError, InputError
from qexp.models.families import Family, StateDict, llama_params, register_family


# config.json keys the Qwen converters read beyond the neutral ones (qexp/models/hf_config.py); sliding-window keys
# are understood as long as use_sliding_window is off (every released Qwen2.5 / Qwen3 text model), whatever their
# window and layer count
QWEN_KEYS = ("hidden_act", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "use_mrope")


def _check_supported(c: dict, family: str) -> None:
    """Refuse what the static llama cannot express (one line each)."""
    from qexp.models.hf_config import require, rope_scaling

    sliding = c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or [])
    if sliding:
        raise InputError(f"{family}: sliding-window attention (use_sliding_window / layer_types) is not supported",
                         "qexp's static llama runs full attention; use a checkpoint with use_sliding_window=false")
    require(c, family, "use_mrope", (False,), "multimodal RoPE (Qwen2-VL) is not a text decoder qexp converts")
    scaling = rope_scaling(c)
    if scaling is not None:  # upstream's HF RoPE table (use_hf_rope) has no scaling at all
        raise InputError(f"{family}: RoPE scaling {scaling['rope_type']!r} is not supported",
                         "ExecuTorch's static llama computes Qwen's RoPE unscaled (released Qwen2.5 / Qwen3 configs "
                         "have rope_scaling null; remove a yarn entry added for long contexts)")


def _qwen_params(c: dict, family: str, understood: tuple = QWEN_KEYS) -> dict:
    _check_supported(c, family)
    params = llama_params(c, family, understood)
    params["use_hf_rope"] = True  # HF's RoPE table (equal to Meta's for plain RoPE) on HF-ordered q/k rows
    if "head_dim" in c:
        params["head_dim"] = c["head_dim"]
    return params


def qwen2_params(c: dict) -> dict:
    params = _qwen_params(c, "qwen2")
    params["attention_qkv_bias"] = True  # Qwen2 always has q/k/v biases (no config switch)
    return params


def qwen3_params(c: dict) -> dict:
    if c.get("attention_bias"):
        raise InputError("qwen3: attention_bias=true is not supported",
                         "ExecuTorch's Qwen3 converter maps no q/k/v biases (released Qwen3 models have none)")
    params = _qwen_params(c, "qwen3", QWEN_KEYS + ("attention_bias",))
    params.update(head_dim=c.get("head_dim", 128), use_qk_norm=True, qk_norm_before_rope=True)
    return params


def _finish(out: StateDict, sd: StateDict) -> StateDict:
    if "lm_head.weight" not in sd:  # tied embeddings (Qwen2.5-0.5B, Qwen3-0.6B): as upstream's converters
        out["output.weight"] = out["tok_embeddings.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}


def qwen2_state_dict(sd: StateDict, params: dict) -> StateDict:
    """Upstream's qwen_2_5_hf_to_meta, with ExecuTorch's get_mapped_key (q/k/v biases included)."""
    from qexp import upstream

    inverted = {hf: meta for meta, hf in upstream.QWEN_2_5_FROM_META.items()}
    return _finish(_converted("qwen2", lambda: {upstream.get_mapped_key(k, inverted): v for k, v in sd.items()}), sd)


def qwen3_state_dict(sd: StateDict, params: dict) -> StateDict:
    from qexp import upstream

    return _finish(_converted("qwen3", lambda: upstream.qwen_3_tune_to_meta(sd)), sd)


def _converted(family: str, convert) -> StateDict:
    try:
        return convert()
    except Exception as exc:  # noqa: BLE001 - upstream's get_mapped_key raises a bare Exception on unknown names
        raise InputError(f"{family}: cannot convert the weights ({str(exc).splitlines()[0][:200]})",
                         f"the folder's weights are not a plain {family} checkpoint") from exc


def _tiny_qwen(spec, common: dict) -> dict:
    # As the released Qwen2.5-0.5B / Qwen3-0.6B: eps 1e-6, theta 1e6, tied embeddings, no sliding window.
    return dict(common, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)


def tiny_qwen2(spec, common: dict) -> tuple:
    import transformers

    if spec.head_dim and spec.head_dim != spec.dim // spec.n_heads:
        raise ConfigError("a tiny qwen2 has head_dim = dim // n_heads (Qwen2 has no head_dim setting)")
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**_tiny_qwen(spec, common))


def tiny_qwen3(spec, common: dict) -> tuple:
    import transformers

    head_dim = spec.head_dim or spec.dim // spec.n_heads
    config = transformers.Qwen3Config(**_tiny_qwen(spec, common), head_dim=head_dim, attention_bias=False)
    return transformers.Qwen3ForCausalLM, config


QWEN2 = register_family(Family("qwen2", ("Qwen2ForCausalLM",), qwen2_params, qwen2_state_dict, hf_rope_layout=True,
                               features=frozenset({"qkv_bias"}), gguf_architectures=("qwen2",), tiny=tiny_qwen2))
QWEN3 = register_family(Family("qwen3", ("Qwen3ForCausalLM",), qwen3_params, qwen3_state_dict, hf_rope_layout=True,
                               features=frozenset({"qk_norm"}), gguf_architectures=("qwen3",), tiny=tiny_qwen3))
