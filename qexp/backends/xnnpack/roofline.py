"""The decode roofline on this CPU: bytes a decode step must read vs the machine's measured memory bandwidth."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from qexp.cache import Cache, stable_hash


def measured_bandwidth_gbs(cache: Cache, threads: int, mbytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory bandwidth: best of `repeats` copies of a `mbytes` buffer (read + write bytes / s),
    with the decode's thread count. Cached per CPU model and thread count (a copy benchmark takes ~1 s)."""
    from qexp.core.provenance import cpu_model

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
