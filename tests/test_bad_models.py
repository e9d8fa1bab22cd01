"""Bad model input: an architecture qexp cannot serve, a tokenizer that does not fit the weights, a checkpoint
whose shapes disagree with its config, an unreadable GGUF: one `qexp: error:` line each, exit 2, and the MLflow run
FAILED with the reason; nothing is calibrated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY
from qexp.cache import Cache
from qexp.models.sources import load_model


def _qexp(args, cache_dir, store_uri):
    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir), "MLFLOW_TRACKING_URI": store_uri}
    return subprocess.run([sys.executable, "-m", "qexp", *args, "tracking.experiment=bad_models", "backend=none"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_folder(compose, cache_dir) -> Path:
    return Path(load_model(compose(TINY).model, Cache(cache_dir)).hf_dir)


def _folder_with(tmp_path: Path, source: Path, config_change: dict | None = None, tokenizer_from: Path | None = None):
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    if config_change:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_change}))
    if tokenizer_from:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _assert_one_line_and_failed(out, store_uri, expected: str):
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("qexp: error:")]
    assert len(errors) == 1 and expected in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    runs = MlflowClient(store_uri).search_runs(
        [MlflowClient(store_uri).get_experiment_by_name("bad_models").experiment_id],
        order_by=["attributes.start_time DESC"], max_results=1)
    assert runs[0].info.status == "FAILED" and expected in runs[0].data.tags.get("error", runs[0].data.tags.get(
        "mlflow.note.content", "")), runs[0].data.tags


def test_unsupported_architecture(tiny_folder, tmp_path, cache_dir, store_uri):
    folder = _folder_with(tmp_path, tiny_folder, {"architectures": ["MistralForCausalLM"]})
    out = _qexp(["model=hf", f"model.path={folder}"], cache_dir, store_uri)
    _assert_one_line_and_failed(out, store_uri, "architecture MistralForCausalLM is not supported")
    assert "Gemma3ForCausalLM" in out.stderr and "Qwen3ForCausalLM" in out.stderr


def test_shapes_disagree_with_config(tiny_folder, tmp_path, cache_dir, store_uri):
    folder = _folder_with(tmp_path, tiny_folder, {"intermediate_size": 256})  # the weights have 128
    out = _qexp(["model=hf", f"model.path={folder}"], cache_dir, store_uri)
    _assert_one_line_and_failed(out, store_uri, "checkpoint does not match its params")


def test_tokenizer_larger_than_the_embedding(compose, cache_dir, tmp_path, store_uri):
    """A 512-row model with a 1024-token tokenizer (another tiny model's)."""
    small = Path(load_model(compose(TINY).model, Cache(cache_dir)).hf_dir)
    big = Path(load_model(compose(TINY + ["model.tiny.vocab_size=1024"]).model, Cache(cache_dir)).hf_dir)
    folder = _folder_with(tmp_path, small, tokenizer_from=big)
    out = _qexp(["model=hf", f"model.path={folder}"], cache_dir, store_uri)
    _assert_one_line_and_failed(out, store_uri, "but the model's embedding has 512 rows")


def test_unreadable_gguf(tmp_path, cache_dir, store_uri):
    """A GGUF transformers cannot read (here: not GGUF at all; an unknown family fails the same way)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    out = _qexp(["model.source=gguf", f"model.path={gguf}"], cache_dir, store_uri)
    _assert_one_line_and_failed(out, store_uri, "cannot read GGUF file")
