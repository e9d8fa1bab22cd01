"""The pipeline's public entry points: `prepare` runs the stages up to one without tracking (benchmarks use it), and
backend hooks reach the earlier stages (the calibration graph is annotated for the backend's SoC)."""

from __future__ import annotations

import mlflow
import pytest

from helpers import TINY
from qexp.backends import get_backend
from qexp.pipeline import STAGES, prepare


def test_prepare_runs_stages_untracked(compose, store_uri):
    cfg = compose(TINY + ["quant=16a8w"])
    mlflow.set_tracking_uri(store_uri)
    before = len(mlflow.search_runs(search_all_experiments=True))
    state = prepare(cfg, through="fp")
    assert state.windows.n_windows == 3 and state.fp.logprobs.shape == (3, 63) and state.qdq is None
    state = prepare(cfg, through="qdq")
    assert state.qdq is not None and "ppl_qdq" in state.metrics and state.deploy_model is state.model
    assert len(mlflow.search_runs(search_all_experiments=True)) == before  # nothing was logged
    with pytest.raises(ValueError, match="stages: " + ", ".join(STAGES)):
        prepare(cfg, through="compile")


def test_calibration_is_annotated_for_the_backends_soc(compose):
    from qexp.core.provenance import qdq_cache_key

    cfg = compose(TINY + ["backend=htp", "backend.soc=SM8750"])
    assert get_backend("htp").quantizer_soc(cfg) == "SM8750"
    assert get_backend("none").quantizer_soc(compose(TINY)) == "SM8650"  # a QDQ-only run: the default SoC
    state = prepare(compose(TINY + ["quant=16a8w"]), through="calibration")
    state.deploy_static = state.fp_static
    keys = {soc: qdq_cache_key(state.cfg, state.model, state.deploy_static, state.calibration, soc)
            for soc in ("SM8650", "SM8750")}
    assert keys["SM8650"] != keys["SM8750"]


def test_a_run_builds_its_algorithms_once(compose, monkeypatch):
    """The run's name, its checks, the calibration, transform and QDQ stages all use the transforms validate() built:
    each algorithm's object is constructed once per run."""
    from qexp.pipeline import run_experiment
    from qexp.transforms.base import TRANSFORMS

    built = []
    for name in ("rotation", "seq_mse"):
        cls = TRANSFORMS[name]
        counted = type(cls.__name__, (cls,), {"__init__": lambda self, config, _cls=cls: (
            built.append(_cls.name), _cls.__init__(self, config))[-1]})
        monkeypatch.setitem(TRANSFORMS, name, counted)
    cfg = compose(TINY + ["quant=16a4w", "algorithm=[rotation]", "+algorithm.seq_mse={candidates: 5}"])
    result = run_experiment(cfg)
    assert result.tags["algorithm"].startswith("rotation") and "seq_mse" in result.tags["algorithm"]
    assert sorted(built) == ["rotation", "seq_mse"]
