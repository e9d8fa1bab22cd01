"""XNNPACK backend (CPU): the model through ExecuTorch's LLM export path, run as a .pte on this CPU.

Export is upstream's `export_llama` flow (`_export_llama(LlmConfig)`): the ExecuTorch llama transformer with a KV
cache and the custom SDPA op, source-transform quantization (`qmode`: 8da4w / 8da8w, group size,
optional embedding quantization) and XNNPACK delegation. qexp only writes the Meta checkpoint it reads and caches the
.pte content-addressed. One program per config, the one a runner deploys (last position's logits): perplexity steps
it one token per call through its KV cache, exactly as generation does; exporting a second, full-logits program
would cost more (upstream's lowering takes minutes for SmolLM2) than stepping the windows.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence

import torch

from qexp.cache import Cache, stable_hash
from qexp.config import XNNPACK_BROKEN_QMODES, XNNPACK_GROUPED, XNNPACK_QMODES
from qexp.errors import ConfigError
from qexp.load import LoadedModel
from qexp.speed import Generation

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


def validate_xnnpack(cfg) -> None:
    backend = cfg.backend
    if cfg.quant.scheme != "fp32":
        raise ConfigError(
            f"quant={cfg.quant.name} is a QNN (HTP) scheme; backend=xnnpack quantizes with backend.qmode",
            f"use quant=fp32 with backend=xnnpack backend.qmode=8da4w (or {', '.join(XNNPACK_QMODES)})",
        )
    if backend.qmode in XNNPACK_BROKEN_QMODES:
        raise ConfigError(f"backend.qmode={backend.qmode}: {XNNPACK_BROKEN_QMODES[backend.qmode]}",
                          f"use one of: {', '.join(XNNPACK_QMODES)}")
    if backend.qmode not in XNNPACK_QMODES:
        raise ConfigError(f"unknown backend.qmode {backend.qmode!r}", f"choose one of: {', '.join(XNNPACK_QMODES)}")
    if backend.qmode in XNNPACK_GROUPED and backend.group_size <= 0:
        raise ConfigError(f"backend.group_size={backend.group_size}", "use a positive group size, e.g. 32")
    if backend.embedding_quantize:
        parts = str(backend.embedding_quantize).split(",")
        if len(parts) != 2 or parts[0] not in ("4", "8") or not parts[1].isdigit():
            raise ConfigError(f"backend.embedding_quantize={backend.embedding_quantize!r}",
                              "use '<bits>,<group size>' with bits 4 or 8 and group 0 (per row) or e.g. 32: '8,0'")
    if backend.threads < 1:
        raise ConfigError(f"backend.threads={backend.threads}", "use at least 1 thread")


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
    from executorch.examples.models.llama.export_llama_lib import _export_llama
    from executorch.extension.llm.export.config.llm_config import LlmConfig, ModelType

    key = stable_hash({
        "version": _XNNPACK_CACHE_VERSION, "model": model.fingerprint, "qmode": backend.qmode,
        "group_size": backend.group_size if backend.qmode in XNNPACK_GROUPED else None,
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
            llm.quantization.group_size = int(backend.group_size) if backend.qmode in XNNPACK_GROUPED else None
        if backend.embedding_quantize:
            llm.quantization.embedding_quantize = str(backend.embedding_quantize)
        start = time.perf_counter()
        _export_llama(llm)
        timing["export_s"] = time.perf_counter() - start
        return {"export_s": timing["export_s"], "qmode": backend.qmode}

    path, hit = cache.get_or_build("xnnpack", key, build)
    log.info("XNNPACK program %s (%s)", path, "cache hit" if hit else "built")
    return XnnpackProgram(path / PTE_FILE, key, hit, timing.get("export_s", 0.0))


def load_runtime_ops() -> None:
    """Kernels an LLM .pte needs that the pybindings load on import only (FIELD-NOTES)."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 - llama::custom_sdpa / update_cache
    import executorch.kernels.quantized  # noqa: F401 - quantized_decomposed::embedding_*bit


class XnnpackRunner:
    """Drives one .pte: tokens + start position in, logits out; the KV cache lives in the program's buffers."""

    def __init__(self, program: XnnpackProgram, threads: int):
        from executorch.extension.pybindings import portable_lib

        load_runtime_ops()
        portable_lib._unsafe_reset_threadpool(int(threads))
        self.threads = portable_lib._threadpool_get_thread_count()
        self.program = program
        self.module = portable_lib._load_for_executorch(str(program.pte_path))

    def forward(self, tokens: Sequence[int], start_pos: int) -> torch.Tensor:
        """Logits [1, vocab] of the last of `tokens`, placed at positions start_pos...

        Positions restart at 0 for a new sequence: the SDPA op attends to [0, start_pos + n), so what an earlier
        sequence left further on in the cache is never read."""
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = self.module.forward((ids, torch.tensor([start_pos], dtype=torch.long)))[0]
        return out.reshape(-1, out.shape[-1])

    def window_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(ids), vocab]: one decode step per position."""
        return torch.cat([self.forward([token], position) for position, token in enumerate(ids)])

    def generate(self, prompt: Sequence[int], n_new: int) -> Generation:
        """Greedy: the prompt in one prefill call, then one call per new token, timed around each call."""
        start = time.perf_counter()
        token = int(self.forward(prompt, 0)[-1].argmax())
        prefill_end = time.perf_counter()
        tokens = [token]
        for step in range(n_new - 1):
            token = int(self.forward([token], len(prompt) + step)[-1].argmax())
            tokens.append(token)
        end = time.perf_counter()
        return Generation(tokens, prefill_end - start, prefill_end - start, end - prefill_end, len(prompt))


# ---------------------------------------------------------------- roofline
def measured_bandwidth_gbs(cache: Cache, threads: int, mbytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory bandwidth: best of `repeats` copies of a `mbytes` buffer (read + write bytes / s),
    with the decode's thread count. Cached per CPU model and thread count (a copy benchmark takes ~1 s)."""
    from qexp.pipeline import cpu_model

    def build(tmp: Path) -> dict:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            src = torch.ones(mbytes * (1 << 20) // 4, dtype=torch.float32)
            dst = torch.empty_like(src)
            best = float("inf")
            for _ in range(repeats + 1):  # the first copy faults the pages in
                start = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(previous)
        gbs = 2 * src.numel() * 4 / best / 1e9
        (tmp / "bandwidth.json").write_text(json.dumps({"gbs": gbs}))
        return {"cpu": cpu_model(), "threads": threads, "mbytes": mbytes}

    path, _ = cache.get_or_build("membw", stable_hash([cpu_model(), threads, mbytes], length=16), build)
    return json.loads((path / "bandwidth.json").read_text())["gbs"]


def decode_bytes_per_token(pte_bytes: int, params: dict, embedding_quantize: str | None, position: float) -> float:
    """Bytes a decode step reads: every weight in the program once, except the embedding table (one row), plus the
    fp32 KV cache up to `position`."""
    dim, vocab = int(params["dim"]), int(params["vocab_size"])
    bits = int(str(embedding_quantize).split(",")[0]) if embedding_quantize else 32
    table = vocab * dim * bits / 8
    n_heads = int(params["n_heads"])
    kv_heads = int(params.get("n_kv_heads") or n_heads)
    kv = 2 * int(params["n_layers"]) * kv_heads * (dim // n_heads) * position * 4
    return pte_bytes - table + table / vocab + kv


# ---------------------------------------------------------------- the phase
def run_xnnpack_phase(cfg, model: LoadedModel, windows, fp, cache: Cache, timer, versions: Dict[str, str]):
    """Export (cached), perplexity of the .pte on the FP phase's windows, speed and roofline. -> (metrics, tags)"""
    import math

    from qexp.evaluate import evaluate, sqnr_db
    from qexp.speed import measure

    backend, bench = cfg.backend, cfg.bench
    context = max(windows.seq_len, bench.prompt_len + bench.new_tokens)
    max_prefill = max(windows.seq_len, bench.prompt_len)
    metrics: Dict[str, float] = {}
    with timer.stage("export_xnnpack"):
        program = export_program(model, backend, context, max_prefill, cache, versions)
    tags = {"target": "cpu", "xnnpack_qmode": backend.qmode, "pte_cache_key": program.key,
            "pte_cache_hit": str(program.cache_hit).lower()}
    metrics["pte_bytes"] = program.pte_bytes
    runner = XnnpackRunner(program, backend.threads)

    with timer.stage("eval_deployed"):
        deployed = evaluate(runner.window_logits, windows, "XNNPACK", reference=fp, keep_logits=len(fp.logits))
    metrics.update({f"{k}_deployed": v for k, v in deployed.metrics().items()})
    metrics["ppl_deployed_vs_fp"] = metrics["ppl_deployed"] / fp.metrics()["ppl"] - 1.0
    metrics["top1_agreement_deployed_vs_fp"] = deployed.extras["top1_agreement"]
    metrics["logits_sqnr_db_deployed"] = float(sum(sqnr_db(a, b) for a, b in zip(fp.logits, deployed.logits))
                                               / max(len(fp.logits), 1))
    log.info("XNNPACK %s: ppl %.3f (%+.2f%% vs FP) on the FP phase's %d windows", backend.qmode,
             metrics["ppl_deployed"], 100 * metrics["ppl_deployed_vs_fp"], windows.n_windows)

    prompt = [int(t) for t in windows.ids[0][: bench.prompt_len]]
    with timer.stage("bench_xnnpack"):
        speed, _ = measure(lambda: runner.generate(prompt, bench.new_tokens), bench.warmup, bench.repeats)
    metrics.update({k: v for k, v in speed.items() if not math.isnan(v)})
    metrics["threads"] = runner.threads

    bandwidth = measured_bandwidth_gbs(cache, runner.threads)
    per_token = decode_bytes_per_token(program.pte_bytes, model.params, backend.embedding_quantize,
                                       bench.prompt_len + bench.new_tokens / 2)
    metrics.update({"mem_bandwidth_gbs": bandwidth, "decode_bytes_per_token": per_token})
    if "decode_tok_s" in metrics:
        achieved = per_token * metrics["decode_tok_s"] / 1e9
        metrics.update({"decode_achieved_gbs": achieved, "decode_bw_efficiency": achieved / bandwidth})
    log.info("speed on cpu (%d threads): TTFT %.1f ms, prefill %.1f tok/s, decode %.1f tok/s; decode reads %.1f MB/token"
             " = %.2f GB/s of %.2f GB/s measured (%.0f%%)", runner.threads, metrics["ttft_ms"],
             metrics["prefill_tok_s"], metrics.get("decode_tok_s", float("nan")), per_token / 1e6,
             metrics.get("decode_achieved_gbs", float("nan")), bandwidth,
             100 * metrics.get("decode_bw_efficiency", float("nan")))
    return metrics, tags
