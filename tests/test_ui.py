"""The MLflow UI as a researcher sees it, in a real headless Chromium against `python -m qexp.ui`: the runs table
in qexp's view (names, one-line results, perplexity columns, datasets) and the charts that compare runs.

Skips, saying why, where no Chromium is installed (`make test` installs Debian's). QEXP_UI_SCREENSHOTS=<dir> keeps
the screenshots (docs/ui/ holds the committed ones).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY, free_port, wait_until_healthy
from qexp.pipeline import run_experiment

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium "
                                "(scripts/setup_test_system.sh, run by `make test`, does it)")


def _rendered(url: str, needle: str) -> tuple:
    """(the page once it shows `needle`, the time budget that took): the UI renders after its API calls and loads
    its chart library on demand, so a loaded machine may need longer."""
    page, budget = "", 0
    for budget in (15_000, 30_000, 60_000):
        page = _browser(url, "--dump-dom", budget=budget)
        if needle in page:
            break
    return page, budget


def _browser(url: str, *args: str, budget: int = 25_000) -> str:
    """Load `url` in headless Chromium, let its scripts run, return what it printed (--dump-dom: the page).

    A fresh profile each time: the UI keeps state in the browser (the GenAI/Model training switch, table state)."""
    with tempfile.TemporaryDirectory() as profile:
        command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--user-data-dir={profile}", "--window-size=1920,1000", f"--virtual-time-budget={budget}",
                   *args, url]
        return subprocess.run(command, capture_output=True, text=True, timeout=300).stdout


@pytest.fixture(scope="module")
def ui(compose, tmp_path_factory):
    """A store with three tiny runs in one experiment, served by `python -m qexp.ui`; yields its printed addresses."""
    store = f"sqlite:///{tmp_path_factory.mktemp('ui') / 'mlruns.db'}"
    for overrides in (["quant=16a8w"], ["quant=16a4w"], ["quant=16a4w", "observer=moving_average"]):
        run_experiment(compose(TINY + overrides + [f"tracking.uri={store}", "tracking.experiment=ui"]))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qexp.ui", "--tracking-uri", store, "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first_line = proc.stdout.readline()
    wait_until_healthy(f"http://127.0.0.1:{port}", proc, "the MLflow UI")
    yield store, first_line
    proc.terminate()
    proc.wait(timeout=30)
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"the UI left processes behind: {leftovers}"  # `mlflow ui` ignores SIGTERM


def _address(printed: str) -> str:
    match = re.match(r"qexp\.ui: ui \(3 runs\): (http://\S+)$", printed.strip())
    assert match, printed
    return match.group(1)


def _keep(screenshot: Path) -> None:
    keep = os.environ.get("QEXP_UI_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(keep) / screenshot.name)


def test_the_ui_opens_on_the_runs_table_in_qexps_view(ui, tmp_path):
    store, printed = ui
    url = _address(printed)
    page, budget = _rendered(url, "observer=moving_average")
    runs = MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name("ui").experiment_id])
    for run in runs:  # every run's full name and its one-line result are on the page, not cut
        assert run.info.run_name in page
        assert run.data.tags["mlflow.note.content"] in page
    assert "tiny · 16a4w · RTN · none · observer=moving_average" in page
    for header in ("ppl_fp", "ppl_qdq", "ppl_qdq_vs_fp", "Dataset", "Description"):
        assert f">{header}<" in page, header
    assert f"{runs[0].data.tags['text_source']}:test" in page  # the evaluation windows, as a dataset
    _browser(url, f"--screenshot={tmp_path / 'ui_runs.png'}", budget=budget)
    assert (tmp_path / "ui_runs.png").stat().st_size > 20_000
    _keep(tmp_path / "ui_runs.png")


def test_the_compare_charts_show_what_was_quantized_and_its_perplexity(ui, tmp_path):
    store, printed = ui
    url = _address(printed) + "&compareRunsMode=CHART"
    page, budget = _rendered(url, "main-svg")  # plotly has drawn the charts
    assert "qexp: compare runs" in page and "Parallel Coordinates" in page
    for axis in ("quant.name", "observer.name", "ppl_qdq"):  # the parallel plot's axes are qexp's, not MLflow's pick
        assert axis in page, axis
    _browser(url, f"--screenshot={tmp_path / 'ui_charts.png'}", budget=budget)
    assert (tmp_path / "ui_charts.png").stat().st_size > 20_000
    _keep(tmp_path / "ui_charts.png")


def test_older_experiments_get_the_view(tmp_path, compose):
    """An experiment created before qexp set its view (or by hand) gets it from `python -m qexp.ui --prepare-only`."""
    store = f"sqlite:///{tmp_path / 'old.db'}"
    client = MlflowClient(store)
    experiment_id = client.create_experiment("old")
    run = client.create_run(experiment_id, tags={"config_hash": "abc"})
    client.set_terminated(run.info.run_id)
    out = subprocess.run([sys.executable, "-m", "qexp.ui", "--tracking-uri", store, "--prepare-only"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "viewStateShareKey=qexp" in out.stdout
    tags = client.get_experiment(experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert "mlflow.sharedViewState.qexp" in tags and "ppl_qdq" in tags["mlflow.note.content"]

