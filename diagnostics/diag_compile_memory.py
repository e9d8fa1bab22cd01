"""Diagnostic: where the HTP compile's memory goes (against the default run's 6 GiB peak-memory target), one step
at a time.

Runs the configured experiment (default: the default experiment, SmolLM2 16a4w hybrid) through the QDQ phase (cached
stages are cache hits), frees what the deploy stage frees (garbage collection, then glibc's malloc_trim, as
qexp.core.timing.release_memory does), then in this one process: builds each deploy graph
(export, prepare, observer statistics, convert), lowers each graph on its own (ExecuTorch + QNN, no cache), and
emits the program. Prints the process's resident memory after each step and the peak within it (sampled every
50 ms from /proc/self/statm), so the steps' shares of the peak can be read off. Nothing is cached or tracked.

    .venv/bin/python diagnostics/diag_compile_memory.py
    .venv/bin/python diagnostics/diag_compile_memory.py model=gemma3_270m
    .venv/bin/python diagnostics/diag_compile_memory.py --parallel   # the default path: compile_workers=2
    .venv/bin/python diagnostics/diag_compile_memory.py --in-turn    # compile_workers=1: one graph after the other

--parallel builds and lowers the graphs as a default run does (the first here, the others in forked workers,
each worker building its own graph after the fork; qexp/backends/htp/parallel.py) and prints this process's RSS
and each worker's at each point of it (after the fork, after lowering here, after each worker ends, after its
program is read back and deserialized), with the peak between the points, and the peak rise of the machine's
memory in use since the lowering started (each page counted once: the whole tree's physical memory beyond this
process's RSS at the start; summed RSS counts the pages a worker shares with this process twice).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import machine_used_mib  # noqa: E402

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


def children_rss_mib() -> dict:
    import psutil

    out = {}
    for child in psutil.Process().children():
        try:
            out[child.pid] = child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


class Points:
    """RSS of this process and its children at named points of the parallel lowering, and the peaks between them."""

    def __init__(self):
        self.peak, self.child_peak, self._stop = 0.0, 0.0, threading.Event()
        # the machine's memory in use (each page once, so shared copy-on-write pages are not counted twice), as a rise
        # over what was in use when the lowering started: this process's part of it is its RSS at that point
        self.machine_before = self.machine_peak = machine_used_mib()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, rss_mib())
            self.child_peak = max([self.child_peak, *children_rss_mib().values()])
            self.machine_peak = max(self.machine_peak, machine_used_mib())

    def mark(self, label: str):
        kids = children_rss_mib()
        print(f"  {label:44s} here {rss_mib() / 1024:5.2f} GiB (peak since last {self.peak / 1024:5.2f})   "
              f"workers {', '.join(f'{v / 1024:.2f}' for v in kids.values()) or '-'} GiB "
              f"(peak since last {self.child_peak / 1024:5.2f})   machine in use +"
              f"{(self.machine_peak - self.machine_before) / 1024:5.2f} GiB at peak since last", flush=True)
        self.peak, self.child_peak = rss_mib(), max(kids.values(), default=0.0)
        self.machine_peak = machine_used_mib()

    def stop(self):
        self._stop.set()


def instrument_parallel(points: Points) -> None:
    """Wrap the parallel lowering's steps so each prints the memory at its end."""
    from qexp.backends.htp import parallel

    fork, collect, waitpid = parallel._fork, parallel._collect, os.waitpid
    workers = set()

    def _fork(name, *a, **k):
        pid = fork(name, *a, **k)
        workers.add(pid)
        points.mark(f"forked the worker for {name}")
        return pid

    def _waitpid(pid, options):
        if pid not in workers:  # subprocess waits for its children through os.waitpid too
            return waitpid(pid, options)
        workers.discard(pid)
        points.mark("lowered the first graph here")
        out = waitpid(pid, options)
        points.mark(f"worker {pid} ended")
        return out

    def _collect(name, *a, **k):
        program = collect(name, *a, **k)
        points.mark(f"read back and deserialized {name}")
        return program

    parallel._fork, parallel._collect = _fork, _collect
    os.waitpid = _waitpid  # parallel.py calls os.waitpid (the one os module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", action="store_true", help="lower as a default run does (compile_workers=2)")
    parser.add_argument("--in-turn", action="store_true",
                        help="lower as compile_workers=1 does (one graph after the other, per-graph contexts)")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    import torch

    from qexp.backends.htp.config import W4Lowering
    from qexp.backends.htp.lower import build_and_lower, deploy_graph, graph_ar_lens
    from qexp.pipeline import prepare
    from qexp.core.timing import release_memory
    from qexp.upstream.private import provenance_without_deep_copies

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=16a4w_wikitext", *args.overrides])
    state = step("stages through QDQ (cache hits)", lambda: prepare(cfg, "qdq"))
    state.fp_static = state.deploy_static = None  # what the deploy stage frees before compiling
    state.qdq.release_programs()
    step("free the FP / QDQ float programs (gc)", gc.collect)
    step("  + malloc_trim (release_memory)", release_memory)
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk

    ensure_qnn_sdk(state.cache)  # QNN's libraries on the loader path, as compile_pte does
    stats = torch.load(state.qdq.program.stats_path, weights_only=True)
    builders = {name: functools.partial(deploy_graph, state.deploy_model, cfg, name, ar_len, state.qdq.r3, stats,
                                        state.timer)
                for name, ar_len in graph_ar_lens(cfg.backend).items()}
    lpbq = cfg.backend.w4_lowering == W4Lowering.lpbq
    with provenance_without_deep_copies():
        if args.in_turn:  # as compile_pte: each graph built where and when it is lowered
            step("build + lower all graphs in turn (+ to_executorch)",
                 lambda: build_and_lower(builders, state.timer, lpbq, workers=1))
            return
        if args.parallel:
            points = Points()
            instrument_parallel(points)
            points.mark("before lowering")
            step("build + lower all graphs in workers (+ to_executorch)",
                 lambda: build_and_lower(builders, state.timer, lpbq, workers=2))
            points.stop()
            return
        for name, build in builders.items():
            graph = step(f"build {name}", build)
            step(f"lower {name} alone (+ to_executorch)",
                 # F821 false positive: the lambda runs (inside step) before `del graph` below
                 lambda: build_and_lower({name: lambda: graph}, state.timer, lpbq, workers=1))  # noqa: F821
            del graph
            step(f"free {name} (gc)", gc.collect)
            step("  + malloc_trim (release_memory)", release_memory)


if __name__ == "__main__":
    main()
