"""The tiny random test model: a seeded HF LlamaForCausalLM and a small BPE tokenizer trained on shipped news text,
materialised as an HF folder in the cache, so it loads through the same path as a user's HF folder."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qexp.cache import Cache, stable_hash
from qexp.config import TinyModelSpec

# Bump when the content of a cached tiny model folder changes for the same spec.
_TINY_CACHE_VERSION = 1


def tiny_key(spec: TinyModelSpec) -> dict:
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(vars(spec))
    return {**fields, "version": _TINY_CACHE_VERSION}


def tiny_hf_folder(spec: TinyModelSpec, cache: Cache) -> str:
    """A random Llama (HF LlamaForCausalLM, seeded) and a small byte-level BPE trained on shipped news text."""

    def build(tmp: Path) -> dict:
        from transformers import LlamaConfig, LlamaForCausalLM

        _train_tiny_tokenizer(spec.vocab_size, tmp)
        config = LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.dim,
            intermediate_size=spec.hidden_dim,
            num_hidden_layers=spec.n_layers,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads,
            max_position_embeddings=spec.max_position_embeddings,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        # Larger-than-default init so the random model has peaked, position-dependent predictions: quantization
        # then visibly changes perplexity, which the tests rely on.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
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
