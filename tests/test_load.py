"""Load stage: the tiny source is deterministic; HF -> Meta -> static llama reproduces transformers; Meta checkpoints
load with their tokenizer; missing and corrupt inputs fail with one clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import TINY
from qexp.cache import Cache
from qexp.core.errors import InputError
from qexp.models.sources import load_model
from qexp.models.static_llama import StaticLlama, window_logits


def test_tiny_model_is_deterministic(tiny_model, compose, tmp_path):
    again = load_model(compose(TINY).model, Cache(tmp_path))  # built from scratch in another cache
    assert again.fingerprint == tiny_model.fingerprint
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(tensor, again.state_dict[name]), name
    assert again.tokenizer.encode("The state of the art.") == tiny_model.tokenizer.encode("The state of the art.")


def test_tiny_tokenizer_round_trips(tiny_model):
    text = "Anarchism is a political philosophy."
    ids = tiny_model.tokenizer.encode(text)
    assert 0 < len(ids) < len(text) and max(ids) < tiny_model.params["vocab_size"]
    assert tiny_model.tokenizer.decode(ids) == text


def test_static_llama_matches_transformers(tiny_model):
    """The FP phase's model (upstream static llama, Meta layout + rope transform) equals HF on the same tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model.hf_dir, dtype=torch.float32).eval()
    static = StaticLlama(tiny_model, max_context_len=64)
    ids = np.arange(5, 69) % tiny_model.params["vocab_size"]
    ours = window_logits(static.module, static, ids)
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_positions_matter(tiny_model):
    """Guards the upstream trap: example inputs carry zero positions, which silently disables RoPE."""
    static = StaticLlama(tiny_model, max_context_len=32)
    ids = np.arange(3, 35)
    inputs = list(static.inputs(ids))
    zero_pos = inputs.copy()
    zero_pos[2] = torch.zeros_like(inputs[2])
    with torch.no_grad():
        real, wrong = static.module(*inputs)[0], static.module(*zero_pos)[0]
    assert not torch.allclose(real, wrong)


def _write_meta_checkpoint(tiny_model, folder):
    """A Meta-style checkpoint of the tiny model: consolidated.00.pth + params.json + sentencepiece tokenizer.model."""
    import sentencepiece as spm

    torch.save(tiny_model.state_dict, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps(tiny_model.params))
    sentences = folder / "sentences.txt"
    sentences.write_text("\n".join(f"sentence number {i} about the quick brown fox and friends" for i in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(sentences), model_prefix=str(folder / "tokenizer"), vocab_size=120, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
    )
    return folder / "consolidated.00.pth", folder / "params.json", folder / "tokenizer.model"


def test_meta_checkpoint_source(tiny_model, compose, tmp_path, cache_dir):
    ckpt, params, tok = _write_meta_checkpoint(tiny_model, tmp_path)
    cfg = compose(["model=llama_checkpoint", "model.arch=stories260k", f"model.checkpoint={ckpt}",
                   f"model.params={params}", f"model.tokenizer={tok}"])
    loaded = load_model(cfg.model, Cache(cache_dir))
    assert loaded.tokenizer.kind == "llama2c" and loaded.tokenizer.bos_id == 1
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the quick brown fox")) == "the quick brown fox"
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(tensor, loaded.state_dict[name])


def test_missing_checkpoint(compose, cache_dir, tmp_path):
    cfg = compose(["model=llama_checkpoint", f"model.checkpoint={tmp_path}/nope.pth",
                   f"model.params={tmp_path}/params.json", f"model.tokenizer={tmp_path}/tokenizer.model"])
    with pytest.raises(InputError, match="checkpoint not found"):
        load_model(cfg.model, Cache(cache_dir))


def test_corrupt_checkpoint(tiny_model, compose, cache_dir, tmp_path):
    ckpt, params, tok = _write_meta_checkpoint(tiny_model, tmp_path)
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated download
    cfg = compose(["model=llama_checkpoint", f"model.checkpoint={ckpt}", f"model.params={params}",
                   f"model.tokenizer={tok}"])
    with pytest.raises(InputError, match="cannot load checkpoint"):
        load_model(cfg.model, Cache(cache_dir))


def test_checkpoint_is_loaded_weights_only(tiny_model, compose, cache_dir, tmp_path):
    """A pickle that would execute code is refused (weights_only=True)."""
    ckpt, params, tok = _write_meta_checkpoint(tiny_model, tmp_path)

    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"model": Payload()}, ckpt)
    cfg = compose(["model=llama_checkpoint", f"model.checkpoint={ckpt}", f"model.params={params}",
                   f"model.tokenizer={tok}"])
    with pytest.raises(InputError, match="holds pickled Python objects"):
        load_model(cfg.model, Cache(cache_dir))


def test_corrupt_gguf(compose, cache_dir, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 512)
    with pytest.raises(InputError, match="cannot read GGUF"):
        load_model(compose([f"model.path={bad}"]).model, Cache(cache_dir))


def test_missing_gguf(compose, cache_dir, tmp_path):
    with pytest.raises(InputError, match="GGUF file not found"):
        load_model(compose([f"model.path={tmp_path}/absent.gguf"]).model, Cache(cache_dir))


def test_missing_hf_folder(compose, cache_dir, tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_model(compose(["model=hf", f"model.path={tmp_path}/none"]).model, Cache(cache_dir))


def test_hf_folder_source(tiny_model, compose, cache_dir):
    loaded = load_model(compose(["model=hf", f"model.path={tiny_model.hf_dir}", "model.arch=stories260k"]).model,
                        Cache(cache_dir))
    assert loaded.params == tiny_model.params
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(tensor, loaded.state_dict[name])
    assert len(loaded.fingerprint) == 64  # sha256 of the weight files


def test_tiktoken_tokenizer_file(tmp_path):
    """Llama-3 style tokenizer.model (tiktoken BPE ranks): special tokens in text become special ids."""
    import base64

    from qexp.models.tokenizer import Tokenizer

    ranks = tmp_path / "tokenizer.model"
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    tok = Tokenizer.from_file(str(ranks))
    assert tok.kind == "tiktoken"
    ids = tok.encode("<|begin_of_text|>hi")
    assert ids[0] == tok.bos_id and ids[1:] == [ord("h"), ord("i")]
    assert tok.decode(ids[1:]) == "hi"


def test_a_gguf_file_is_parsed_once(compose, monkeypatch):
    """The block-size check and transformers' loader share one parse of the shipped GGUF (qexp/models/gguf_file.py):
    fails if transformers stops parsing through `gguf.GGUFReader`, or parses it again."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from qexp.models import gguf_file
    from qexp.models.gguf_file import transformers_reading_gguf_once
    from qexp.models.shapes import _read_dims
    from qexp.models.sources import shipped_gguf

    parses = []
    parse = gguf_file._PARSE

    def counted(path, *args, **kwargs):
        parses.append(path)
        return parse(path, *args, **kwargs)

    # every parse, qexp's and any transformers makes around qexp's, goes through the counter
    monkeypatch.setattr(gguf, "GGUFReader", counted)
    monkeypatch.setattr(gguf_file, "_PARSE", counted)
    gguf_file.forget()
    path = shipped_gguf("smollm2_135m")
    try:
        dims = _read_dims(compose([]).model)
        with transformers_reading_gguf_once(path):
            config = load_gguf_checkpoint(path, return_tensors=False)["config"]
            load_gguf_checkpoint(path, return_tensors=False)
        assert gguf.GGUFReader is counted  # restored after the block
        assert len(parses) == 1, parses
        assert config["num_hidden_layers"] == dims["n_layers"] == 30
    finally:
        gguf_file.forget()
