"""Per-stage wall-clock durations and peak memory, logged as `time_<stage>_s` and `peak_rss_mb`."""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from typing import Dict, Iterator

log = logging.getLogger("qexp")


def release_memory() -> None:
    """Collect garbage, then hand the C heap's free pages back to the OS (glibc's malloc_trim). Freed tensors of a
    few MB come from malloc's heap, not from their own mappings, and glibc keeps those pages: measured on SmolLM2
    after the deploy stage freed the FP and QDQ float programs, RSS went 2.44 -> 1.51 GiB with the trim and stayed
    at 2.44 without. It does not lower the default experiment's peak, which comes later, while the graphs are
    lowered (benchmarks/bench_default.py side by side: process 7,854 vs 7,863 MiB, tree 10,905 vs 10,808). No-op
    off glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class StageTimer:
    def __init__(self) -> None:
        self.durations: Dict[str, float] = {}  # stages may nest (quantize > calibrate): do not sum them
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        log.info("stage %s: start", name)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.durations[name] = self.durations.get(name, 0.0) + elapsed
            log.info("stage %s: %.1f s (peak RSS %.0f MiB)", name, elapsed, peak_rss_mb())

    def metrics(self) -> Dict[str, float]:
        out = {f"time_{name}_s": round(value, 3) for name, value in self.durations.items()}
        out["time_total_s"] = round(time.perf_counter() - self.started, 3)
        return out
