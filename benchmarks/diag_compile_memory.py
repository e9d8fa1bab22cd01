"""Diagnostic: where the HTP compile's memory goes (issue #13's peak-memory target), one step at a time.

Runs the configured experiment (default: the default experiment, SmolLM2 16a4w hybrid) through the QDQ phase (cached
stages are cache hits), frees what the deploy stage frees (garbage collection, then glibc's malloc_trim, as
qexp.timing.release_memory does), then in this one process: builds each deploy graph
(export, prepare, observer statistics, convert), lowers each graph on its own (ExecuTorch + QNN, no cache), and
emits the program. Prints the process's resident memory after each step and the peak within it (sampled every
50 ms from /proc/self/statm), so the steps' shares of the peak can be read off. Nothing is cached or tracked.

    .venv/bin/python benchmarks/diag_compile_memory.py
    .venv/bin/python benchmarks/diag_compile_memory.py model=gemma3_270m
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


class Peak:
    """The peak RSS between start() and stop(), sampled in a thread."""

    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()

    def __enter__(self):
        self.peak = rss_mib()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def step(label: str, fn):
    start, t0 = rss_mib(), time.time()
    with Peak() as peak:
        out = fn()
    gc.collect()
    print(f"{label:38s} {time.time() - t0:7.1f} s   before {start / 1024:5.2f} GiB   peak {peak.peak / 1024:5.2f} GiB"
          f"   after {rss_mib() / 1024:5.2f} GiB", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir

    import torch

    from qexp.backends.htp.config import W4Lowering
    from qexp.backends.htp.lower import _deploy_graph, _lower, graph_ar_lens
    from qexp.pipeline import prepare
    from qexp.timing import release_memory
    from qexp.upstream.private import provenance_without_deep_copies

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=16a4w_wikitext", *args.overrides])
    state = step("stages through QDQ (cache hits)", lambda: prepare(cfg, "qdq"))
    state.fp_static = state.static = None  # what the deploy stage frees before compiling
    state.qdq.release_programs()
    step("free the FP / QDQ float programs (gc)", gc.collect)
    step("  + malloc_trim (release_memory)", release_memory)
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk

    ensure_qnn_sdk(state.cache)  # QNN's libraries on the loader path, as compile_pte does
    stats = torch.load(state.qdq.program.stats_path, weights_only=True)
    graphs = {}
    with provenance_without_deep_copies():
        for name, ar_len in graph_ar_lens(cfg.backend).items():
            graphs[name] = step(f"build {name} (AR-{ar_len})", lambda: _deploy_graph(
                state.deploy_model, cfg, name, ar_len, state.qdq.r3, stats, state.timer))
        lpbq = cfg.backend.w4_lowering == W4Lowering.lpbq
        for name in list(graphs):
            graph = {name: graphs[name]}
            step(f"lower {name} alone (+ to_executorch)", lambda: _lower(graph, {}, state.timer, lpbq, workers=1))
            del graphs[name], graph
            step(f"free {name} (gc)", gc.collect)
            step("  + malloc_trim (release_memory)", release_memory)


if __name__ == "__main__":
    main()
