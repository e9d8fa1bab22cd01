"""The tiny random test model: a seeded HF causal LM (Llama, or Qwen2 / Qwen3 / Gemma3 with `family`) and a small
BPE tokenizer trained on shipped news text, materialised as an HF folder in the cache, so it loads through the same
path as a user's HF folder (and its family's converter)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qexp.cache import Cache, stable_hash
from qexp.core.config import TinyModelSpec
from qexp.core.errors import ConfigError

# Bump when the content of a cached tiny model folder changes for the same spec.
_TINY_CACHE_VERSION = 1


# Spec fields added after the first tiny models: left out of the key at these values, so older keys are unchanged.
_KEY_OMITS_DEFAULTS = {"family": "llama", "head_dim": None, "config": None}

RELEASED = Path(__file__).resolve().parent / "released"  # released models' config.json files, by preset name


def tiny_key(spec: TinyModelSpec) -> dict:
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(vars(spec))
    fields = {k: v for k, v in fields.items() if not (k in _KEY_OMITS_DEFAULTS and v == _KEY_OMITS_DEFAULTS[k])}
    return {**fields, "version": _TINY_CACHE_VERSION}


def _hf_model_class(spec: TinyModelSpec):
    """The transformers model class and config of the tiny model's family (same shape fields; the family's own
    switches)."""
    if spec.config:
        return _released_model_class(spec)
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.dim,
        intermediate_size=spec.hidden_dim,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    from qexp.models.families import FAMILIES

    family = FAMILIES.get(spec.family)
    if family is None or family.tiny is None:
        known = ", ".join(sorted(name for name, f in FAMILIES.items() if f.tiny))
        raise ConfigError(f"model.tiny.family={spec.family!r}: no such family with a tiny model", f"choose {known}")
    return family.tiny(spec, common)


def released_config(name: str) -> dict:
    """The config.json of a released model, as shipped in qexp/models/released/."""
    import json

    path = RELEASED / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RELEASED.glob("*.json")))
        raise ConfigError(f"model.tiny.config={name!r} is not a released config qexp ships", f"choose one of: {known}")
    return json.loads(path.read_text())


# TinyModelSpec field -> the config.json key that must hold the same value when model.tiny.config is set
_SPEC_KEYS = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
              "hidden_dim": "intermediate_size", "vocab_size": "vocab_size",
              "max_position_embeddings": "max_position_embeddings"}


def _released_model_class(spec: TinyModelSpec):
    """A released model's config with random weights: every key as released, the first `n_layers` layers."""
    import transformers

    c = released_config(spec.config)
    for field, key in {**_SPEC_KEYS, **({"head_dim": "head_dim"} if spec.head_dim else {})}.items():
        if getattr(spec, field) != c.get(key):
            raise ConfigError(f"model.tiny.{field}={getattr(spec, field)} but the released config {spec.config} has "
                              f"{key}={c.get(key)}", f"set model.tiny.{field}={c.get(key)}, or drop model.tiny.config")
    if not 1 <= spec.n_layers <= c["num_hidden_layers"]:
        raise ConfigError(f"model.tiny.n_layers={spec.n_layers}: {spec.config} has {c['num_hidden_layers']} layers",
                          "use 1 to that many (the model's first layers)")
    from qexp.models.families import family_of_hf_architecture

    family = family_of_hf_architecture(c["architectures"][0])
    if family is None or family.name != spec.family:  # the family decides the random init below
        raise ConfigError(f"model.tiny.family={spec.family} but the released config {spec.config} is "
                          f"{c['architectures'][0]}", f"set model.tiny.family={family.name if family else '?'}")
    c = dict(c, num_hidden_layers=spec.n_layers)
    if isinstance(c.get("layer_types"), list):
        c["layer_types"] = c["layer_types"][: spec.n_layers]
    architecture = c["architectures"][0]
    config = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    return getattr(transformers, architecture), config


def tiny_hf_folder(spec: TinyModelSpec, cache: Cache) -> str:
    """A random model of `spec.family` (HF *ForCausalLM, seeded) and a small byte-level BPE trained on shipped news
    text."""

    def build(tmp: Path) -> dict:
        from qexp.models.families import FAMILIES

        model_class, config = _hf_model_class(spec)  # before the tokenizer: a bad family fails at once
        features = FAMILIES[spec.family].features
        _train_tiny_tokenizer(spec.vocab_size, tmp)
        torch.manual_seed(spec.seed)
        model = model_class(config)
        # Larger-than-default init so the random model has peaked, position-dependent predictions: quantization
        # then visibly changes perplexity, which the tests rely on. A released config keeps transformers' own init
        # (its initializer_range) for the matrices: logits of the size a trained model's have, not a collapsed one's.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    if not spec.config:
                        p.normal_(0.0, 0.08)
                elif "unit_offset_norm" in features and "norm" in name:
                    p.normal_(0.0, 0.1)  # Gemma's gains are (1 + w), zero at init: random, as the q/k norms below
                elif name.endswith(("_proj.bias", "_norm.weight")):
                    # q/k/v biases (zero at init) and q/k norm gains (one at init): random, so the tests see
                    # whether the static graph applies them
                    p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
        model.save_pretrained(tmp)
        return {"spec": tiny_key(spec)}

    path, _ = cache.get_or_build("tiny", stable_hash(tiny_key(spec)), build)
    return str(path)


def _train_tiny_tokenizer(vocab_size: int, out: Path) -> None:
    """Deterministic byte-level BPE on gensim's lee_background.cor (news, not the evaluation text)."""
    import gensim
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", "lee_background.cor")
    with open(corpus, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    )
    fast.save_pretrained(out)
