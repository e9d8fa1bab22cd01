"""Shared fixtures: Hydra composition of the real conf/ tree, a per-session cache and MLflow store.

Every test uses a fresh cache (so CI exercises the cold path: GGUF dequantization, calibration) and its own MLflow
store, never the user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import matplotlib
import pytest

# pytest-xdist's workers share the cores: with PyTorch's default (a thread per core in every worker) the threads
# outnumber the cores and OpenMP's spin-waits burn the CPU the other workers need (docs/testing-and-benchmarks.md).
# Subprocesses inherit the variable.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
# A metric logged without its entry in the metric catalog (qexp/core/metrics.py) fails the test that logs it, in
# this process and in the runs it starts.
os.environ["QEXP_CHECK_METRICS"] = "1"
if _WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import qexp  # noqa: F401,E402 - first: it pins PyTorch's CPU kernels (AVX2), which must happen before any PyTorch operation

# matplotlib's C++ font extension segfaults when first imported into a process that has already run the QNN HTP
# libraries (test_htp, test_smollm2 run before the report tests); imported first, it is fine.
matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402, F401

from helpers import CONF, TINY, free_port, stop_server, wait_until_healthy  # noqa: E402

if _WORKERS:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before this file


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The session's qexp cache, one folder for all pytest workers: what one worker built (a compiled program, the
    converted SmolLM2) another reads instead of building it again, and a worker that wants an entry another is
    building waits for it (qexp's cache is made for jobs sharing a folder; tests/test_shared_cache.py). A test that
    needs a cold cache, or counts what a run adds to one, uses a folder of its own."""
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's basetemp is <session>/popen-gwN: the session folder is their common parent
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "qexp-cache-shared"
    path.mkdir(exist_ok=True)
    os.environ["QEXP_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def store_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"


@pytest.fixture(scope="session")
def compose(cache_dir, store_uri):
    """compose(overrides) -> the resolved DictConfig of conf/ with those overrides, tracked in the test store."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    def _compose(overrides: List[str] | None = None, tracked: bool = True):
        GlobalHydra.instance().clear()
        extra = [f"cache_dir={cache_dir}"]
        if tracked:
            extra += [f"tracking.uri={store_uri}", "tracking.experiment=tests"]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=extra + list(overrides or []))

    return _compose


@pytest.fixture(scope="session")
def tiny_model(compose, cache_dir):
    from qexp.cache import Cache
    from qexp.models import load_model

    return load_model(compose(TINY).model, Cache(cache_dir))


@pytest.fixture(scope="session")
def corpus(compose, cache_dir):
    from qexp.cache import Cache
    from qexp.data.text import load_corpus

    return load_corpus(compose(TINY).text, Cache(cache_dir))


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on loopback, its sqlite store and artifact root in the test's tmp_path."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--default-artifact-root", str(tmp_path / "art"),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no GenAI job consumers (25 processes)
        start_new_session=True,  # its own process group: teardown stops the workers with it
    )
    uri = f"http://127.0.0.1:{port}"
    wait_until_healthy(uri, proc, "mlflow server")
    yield uri
    stop_server(proc)


# Scheduling for pytest-xdist (`--dist loadgroup --no-loadscope-reorder`, the Makefile's `make test`): a unit of work
# is a whole file, except in the files of SPLIT, where each test that uses no module-scoped fixture is a unit of its
# own (their tests share nothing but the worker's session cache). Units go out longest first, by the seconds measured
# in tests/durations.txt (`scripts/test_durations.py` rewrites it): whole files handed out by test count left SmolLM2's
# end-to-end test and the SLURM tests to start last, on one worker, while the other two sat idle.
SPLIT = ("test_smollm2.py", "test_htp.py", "test_speed.py", "test_families.py", "test_cli.py", "test_reliability.py",
         "test_transforms.py", "test_faults.py", "test_qat.py", "test_tasks.py", "test_released_configs.py")
DURATIONS = Path(__file__).with_name("durations.txt")
UNKNOWN_SECONDS = 5.0  # a test not in durations.txt yet


def _measured_seconds() -> dict:
    if not DURATIONS.exists():
        return {}
    pairs = (line.split(" ", 1) for line in DURATIONS.read_text().splitlines() if line.strip())
    return {nodeid: float(seconds) for seconds, nodeid in pairs}


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info else ()
    return any(d[-1].scope in ("module", "class", "package") for d in defs if d)


def _unit(item) -> str:
    if item.path.name in SPLIT and not _uses_module_fixture(item):
        return item.nodeid
    return item.path.name


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "dist", "no") == "loadgroup":
        # where the workers write each test's unit for the controller's scheduler (workers inherit the variable)
        os.environ["QEXP_TEST_UNITS"] = str(Path(config.rootpath, ".pytest-units", f"{os.getpid()}.json"))


def pytest_unconfigure(config):
    path = os.environ.get("QEXP_TEST_UNITS")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(path).unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    seconds = _measured_seconds()
    units: dict = {}
    for index, item in enumerate(items):
        item.qexp_unit = _unit(item)
        units.setdefault(item.qexp_unit, [0.0, index])[0] += seconds.get(item.nodeid, UNKNOWN_SECONDS)
    # stable: the tests of a unit stay together and in file order
    items.sort(key=lambda item: (-units[item.qexp_unit][0], units[item.qexp_unit][1]))
    path = os.environ.get("QEXP_TEST_UNITS")
    if path and os.environ.get("PYTEST_XDIST_WORKER"):
        Path(path).parent.mkdir(exist_ok=True)
        tmp = Path(f"{path}.{os.environ['PYTEST_XDIST_WORKER']}")
        tmp.write_text(json.dumps({item.nodeid: item.qexp_unit for item in items}))
        tmp.replace(path)  # every worker writes the same map; the rename makes each write whole


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    """Under --dist loadgroup, xdist's scopes are our units (xdist's own xdist_group marks rename node ids, which
    pytest 9 no longer allows: they would be silently ignored)."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            if not hasattr(self, "units"):
                self.units = json.loads(Path(os.environ["QEXP_TEST_UNITS"]).read_text())
            return self.units.get(nodeid, nodeid.split("::")[0])

    return UnitScheduling(config, log)


# QEXP_BUILD_TRACE=<file>: each cache build or hit of this process's tests as a JSON line (test, kind, key, hit,
# seconds), to find the tests that build the same entry (docs/testing-and-benchmarks.md); off by default.
if os.environ.get("QEXP_BUILD_TRACE"):
    import time

    from qexp.cache import Cache

    _get_or_build = Cache.get_or_build

    def _traced(self, kind, key, build):
        start = time.time()
        path, hit = _get_or_build(self, kind, key, build)
        with open(os.environ["QEXP_BUILD_TRACE"], "a") as out:
            out.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "kind": kind, "key": key,
                                  "hit": hit, "s": round(time.time() - start, 2), "pid": os.getpid()}) + "\n")
        return path, hit

    Cache.get_or_build = _traced


# QEXP_TEST_CPU=<file>: each test's wall seconds and CPU seconds (its worker's own, and the subprocesses it started
# and reaped: a `python -m qexp`, a sweep, the compile workers) as a JSON line; `scripts/test_profile.py` sums them
# per file. On a 2-core host the suite is CPU-bound, so CPU seconds, not the wall time under load, say what a test
# costs (docs/testing-and-benchmarks.md); off by default.
if os.environ.get("QEXP_TEST_CPU"):
    import resource
    import time

    def _cpu(who) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = (time.time(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))
        yield
        wall, own, children = (time.time() - start[0], _cpu(resource.RUSAGE_SELF) - start[1],
                               _cpu(resource.RUSAGE_CHILDREN) - start[2])
        with open(os.environ["QEXP_TEST_CPU"], "a") as out:
            out.write(json.dumps({"test": item.nodeid, "wall": round(wall, 2), "cpu": round(own, 2),
                                  "cpu_children": round(children, 2),
                                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
