"""One live progress line per graph while it is lowered for HTP.

ExecuTorch's lowering (`to_edge_transform_and_lower_to_qnn`) takes minutes per graph on this kind of machine and
offers no progress hook: most of its time is torch's and ExecuTorch's graph passes, whose length is not known in
advance. So the bars do not pretend to a percentage: each shows the graph, where it is lowered (here or in a worker
process), its elapsed time, and "done in N s" when it is; a ticker thread keeps the clocks moving so a long lowering
never looks hung. The lines are cleared when the lowering ends; the stage line and run.log keep the times.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional


@contextlib.contextmanager
def lowering_bars(labels: Dict[str, str], finished_at: Optional[Dict[str, Callable[[], Optional[float]]]] = None,
                  interval: Optional[float] = None) -> Iterator[Callable[[str], float]]:
    """`labels`: {graph (or group of graphs lowered together): where it runs}. Yields `done(graph) -> seconds`.
    `finished_at`: {graph: () -> the time.time() it finished, or None}, polled by the ticker for graphs lowered in
    other processes, so their bars stop when they do rather than when this process collects them."""
    from tqdm import tqdm

    start, wall_start = time.perf_counter(), time.time()
    bars = {name: tqdm(total=1, desc=f"lower {name} ({where})", bar_format="{desc}", leave=False, position=i,
                       dynamic_ncols=True)
            for i, (name, where) in enumerate(labels.items())}
    finished: Dict[str, float] = {}
    lock = threading.Lock()

    def show(name: str) -> None:
        state = f"done in {finished[name]:.0f} s" if name in finished else f"{time.perf_counter() - start:.0f} s"
        bars[name].set_description_str(f"lower {name} ({labels[name]}): {state}", refresh=True)

    def done(name: str) -> float:
        with lock:
            finished.setdefault(name, time.perf_counter() - start)
            show(name)
        return finished[name]

    stop = threading.Event()
    if interval is None:  # a log file gets a refresh every 30 s, not every second
        interval = 1.0 if sys.stderr.isatty() else 30.0

    def tick() -> None:
        while not stop.wait(interval):
            with lock:
                for name, probe in (finished_at or {}).items():
                    when = probe() if name not in finished else None
                    if when is not None:
                        finished[name] = max(0.0, when - wall_start)
                for name in bars:
                    show(name)

    with lock:
        for name in bars:
            show(name)
    ticker = threading.Thread(target=tick, name="qexp-lowering-bars", daemon=True)
    ticker.start()
    try:
        yield done
    finally:
        stop.set()
        ticker.join()
        for bar in reversed(list(bars.values())):
            bar.close()


def labels_for(names: List[str], worker_pids: Dict[str, int]) -> Dict[str, str]:
    return {name: f"worker process {worker_pids[name]}" if name in worker_pids else "this process" for name in names}
