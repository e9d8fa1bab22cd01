"""XNNPACK export: the model through ExecuTorch's LLM export path (`export_llama`), cached content-addressed.

Upstream's flow (an `LlmConfig`): the ExecuTorch llama transformer with a KV cache and the custom SDPA op,
source-transform quantization (`qmode`: 8da4w / 8da8w, group size, optional embedding quantization) and XNNPACK
delegation. qexp only writes the Meta checkpoint it reads (of the model as the pipeline hands it: transforms
applied) and caches the .pte. One program per config, the one a runner deploys (last position's logits).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import torch

from qexp.backends.xnnpack.config import GROUPED
from qexp.cache import Cache, stable_hash
from qexp.models.loaded import LoadedModel

log = logging.getLogger("qexp")

PTE_FILE = "model.pte"
_XNNPACK_CACHE_VERSION = 1


@dataclass
class XnnpackProgram:
    pte_path: Path
    key: str
    cache_hit: bool
    export_s: float = 0.0

    @property
    def pte_bytes(self) -> int:
        return self.pte_path.stat().st_size


def _meta_checkpoint(model: LoadedModel, cache: Cache) -> Path:
    """The Meta checkpoint + params.json that export_llama reads, written once per model."""
    def build(tmp: Path) -> dict:
        torch.save({k: v.contiguous() for k, v in model.state_dict.items()}, tmp / "consolidated.pth")
        (tmp / "params.json").write_text(json.dumps(model.params))
        return {"model": model.fingerprint}

    path, _ = cache.get_or_build("meta_checkpoint", stable_hash(model.fingerprint, length=24), build)
    return path


def export_program(model: LoadedModel, backend, context: int, max_prefill: int, cache: Cache,
                   versions: Dict[str, str]) -> XnnpackProgram:
    from executorch.extension.llm.export.config.llm_config import LlmConfig, ModelType

    from qexp.upstream.private import export_llama

    key = stable_hash({
        "version": _XNNPACK_CACHE_VERSION, "model": model.fingerprint, "qmode": backend.qmode,
        "group_size": backend.group_size if backend.qmode in GROUPED else None,
        "embedding_quantize": backend.embedding_quantize, "context": context, "max_prefill": max_prefill,
        "versions": versions,
    }, length=24)
    checkpoint = _meta_checkpoint(model, cache)
    timing = {}

    def build(tmp: Path) -> dict:
        llm = LlmConfig()
        llm.base.model_class = ModelType.llama3  # the generic Llama transformer; the params file sets the shape
        llm.base.checkpoint = str(checkpoint / "consolidated.pth")
        llm.base.params = str(checkpoint / "params.json")
        llm.model.use_kv_cache = True
        llm.model.use_sdpa_with_kv_cache = True
        llm.model.enable_dynamic_shape = True
        # export_llama bounds the dynamic token dimension at max_seq_length - 1 and wants context >= max_seq_length
        llm.export.max_seq_length = max_prefill + 1
        llm.export.max_context_length = max(context, max_prefill + 1)
        llm.export.output_dir = str(tmp)
        llm.export.output_name = str(tmp / PTE_FILE)  # used as the full path
        llm.backend.xnnpack.enabled = True
        llm.backend.xnnpack.extended_ops = True
        if backend.qmode != "fp32":
            # 8da8w is implemented by the quantize transform but missing from LlmConfig's list of names, so it is set
            # after construction (the transform validates it).
            llm.quantization.qmode = backend.qmode
            llm.quantization.group_size = int(backend.group_size) if backend.qmode in GROUPED else None
        if backend.embedding_quantize:
            llm.quantization.embedding_quantize = str(backend.embedding_quantize)
        start = time.perf_counter()
        export_llama(llm)
        timing["export_s"] = time.perf_counter() - start
        return {"export_s": timing["export_s"], "qmode": backend.qmode}

    path, hit = cache.get_or_build("xnnpack", key, build)
    log.info("XNNPACK program %s (%s)", path, "cache hit" if hit else "built")
    return XnnpackProgram(path / PTE_FILE, key, hit, timing.get("export_s", 0.0))
