"""The linear layers' weight shapes of a configured model, read from its metadata (config.json, the GGUF header,
params.json, the tiny spec) without loading any weight, so shape-dependent settings (block sizes) are checked before
any work. None when the metadata does not say enough; the check after loading catches those."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

from qexp.core.config import ModelConfig, ModelSource
from qexp.models.families import FAMILIES, family_for_gguf_architecture, family_of_hf_architecture

Shapes = Dict[str, Tuple[int, int]]  # Meta-layout weight name -> (out, in)


def static_module_path(meta_key: str) -> str:
    """The static llama module (1x1 conv) holding a Meta linear weight."""
    if meta_key == "output.weight":
        return "output.conv"
    prefix, name, _ = meta_key.rsplit(".", 2)
    return f"{prefix}.{name}_conv"


def _qk_norm(family) -> bool:
    """An RMSNorm on each q and k head, as the family declares it: the HTP speed model counts one more single-head op
    per q and per k head."""
    return family is not None and "qk_norm" in family.features


def model_dims(cfg: ModelConfig) -> Optional[dict]:
    try:
        return _read_dims(cfg)
    except Exception:  # noqa: BLE001 - unreadable metadata: the load stage reports it, in one line with its fix
        return None


def _read_dims(cfg: ModelConfig) -> Optional[dict]:
    if cfg.source == ModelSource.tiny:
        spec = cfg.tiny
        return {"n_layers": spec.n_layers, "dim": spec.dim, "hidden_dim": spec.hidden_dim, "n_heads": spec.n_heads,
                "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
                "use_qk_norm": _qk_norm(FAMILIES.get(spec.family))}
    if cfg.source == ModelSource.hf and cfg.path:
        path = os.path.join(os.path.expanduser(cfg.path), "config.json")
        if not os.path.isfile(path):
            return None
        outer = json.loads(open(path).read())
        c = outer.get("text_config", outer)
        architecture = (outer.get("architectures") or ["LlamaForCausalLM"])[0]
        return {"n_layers": c.get("num_hidden_layers"), "dim": c.get("hidden_size"),
                "hidden_dim": c.get("intermediate_size"), "n_heads": c.get("num_attention_heads"),
                "n_kv_heads": c.get("num_key_value_heads", c.get("num_attention_heads")),
                "head_dim": c.get("head_dim"), "vocab_size": c.get("vocab_size"),
                "use_qk_norm": _qk_norm(family_of_hf_architecture(architecture))}
    if cfg.source == ModelSource.gguf:
        from qexp.models.sources import SHIPPED_GGUF, shipped_gguf

        if not cfg.path and cfg.name not in SHIPPED_GGUF:
            return None
        try:
            path = os.path.expanduser(cfg.path) if cfg.path else shipped_gguf(cfg.name)
        except Exception:  # noqa: BLE001 - a missing package is reported by the load stage, with its fix
            return None
        if not os.path.isfile(path):
            return None
        from qexp.models.gguf_file import gguf_reader

        fields = gguf_reader(path).fields  # parsed once: the load stage reads the same parse
        arch = str(bytes(fields["general.architecture"].parts[-1]), "utf-8")

        def value(key):
            field = fields.get(f"{arch}.{key}")
            return int(field.parts[field.data[0]][0]) if field is not None and field.data else None

        tokens = fields.get("tokenizer.ggml.tokens")  # `<arch>.vocab_size` is optional (Gemma 3's GGUF omits it)
        return {"n_layers": value("block_count"), "dim": value("embedding_length"),
                "hidden_dim": value("feed_forward_length"), "n_heads": value("attention.head_count"),
                "n_kv_heads": value("attention.head_count_kv"), "head_dim": value("attention.key_length"),
                "vocab_size": value("vocab_size") or (len(tokens.data) if tokens is not None else None),
                "use_qk_norm": _qk_norm(family_for_gguf_architecture(arch))}
    if cfg.source == ModelSource.meta_checkpoint and cfg.params and os.path.isfile(os.path.expanduser(cfg.params)):
        p = json.loads(open(os.path.expanduser(cfg.params)).read())
        return {"n_layers": p.get("n_layers"), "dim": p.get("dim"), "hidden_dim": p.get("hidden_dim"),
                "n_heads": p.get("n_heads"), "n_kv_heads": p.get("n_kv_heads", p.get("n_heads")),
                "vocab_size": p.get("vocab_size")}
    return None


def linear_shapes(cfg: ModelConfig) -> Optional[Shapes]:
    d = model_dims(cfg)
    needed = ("n_layers", "dim", "hidden_dim", "n_heads", "n_kv_heads")
    if d is None or any(not d.get(k) for k in needed):
        return None
    head_dim = d.get("head_dim") or d["dim"] // d["n_heads"]
    q, kv, dim, hidden = d["n_heads"] * head_dim, d["n_kv_heads"] * head_dim, d["dim"], d["hidden_dim"]
    shapes: Shapes = {}
    for i in range(d["n_layers"]):
        prefix = f"layers.{i}."
        shapes.update({prefix + "attention.wq.weight": (q, dim), prefix + "attention.wk.weight": (kv, dim),
                       prefix + "attention.wv.weight": (kv, dim), prefix + "attention.wo.weight": (dim, q),
                       prefix + "feed_forward.w1.weight": (hidden, dim),
                       prefix + "feed_forward.w3.weight": (hidden, dim),
                       prefix + "feed_forward.w2.weight": (dim, hidden)})
    # Every static llama has an lm head (`output.conv`, tied to the embedding or not); the checks read only its input
    # channels, so an unknown vocabulary size is recorded as 0 output channels.
    shapes["output.weight"] = (max(int(d.get("vocab_size") or 0), 0), dim)
    return shapes


def check_gpu_memory(cfg) -> None:
    """check_fits for a run that resolves to CUDA: the model's shapes from its metadata, the GPU torch sees."""
    import torch

    from qexp.core.device import check_fits, resolved_name

    wanted = cfg.get("device", "cpu")
    trains = "qat" in (cfg.get("algorithm") or {}) and resolved_name(cfg.algorithm.qat.get("device", wanted)) == "cuda"
    if not torch.cuda.is_available() or (resolved_name(wanted) != "cuda" and not trains):
        return  # no GPU: check_device (or QAT's own check) has said so
    props = torch.cuda.get_device_properties(0)
    check_fits(model_dims(cfg.model), trains, props.total_memory / 2**30, props.name)
