"""Fitting the speed model to the published figures, and its leave-one-out error.

Decode parameters (bandwidth efficiency, its growth with the NPU generation, the per-head-op cost, the KV cache's
extra cost, Genie's speed-up over ExecuTorch's runner) are fitted to every decode point with `use: true`, in log
space (relative errors: a 20 tok/s model and a 250 tok/s one weigh alike); the prefill compute rate is then fitted
to the TTFT points. Leave-one-out: each point
predicted by the model fitted without it, which is the error a new program's estimate should expect."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from qexp.speed.data import Point, Published, published
from qexp.speed.model import VERSION, CallFeatures, SpeedModel

DECODE_START = (0.5, 0.5, 0.3, 1.5, 1.0)  # bandwidth_efficiency, compute_exponent, head_op_us, kv_extra, genie_speedup
PREFILL_START = 10.0


@dataclass(frozen=True)
class Prediction:
    point: Point
    predicted: float  # by the model fitted on every point
    held_out: float  # by the model fitted without this point (the same for a point not used in the fit)

    @property
    def error(self) -> float:
        return self.held_out / self.point.value - 1


@dataclass(frozen=True)
class Fit:
    model: SpeedModel
    decode: List[Prediction]
    ttft: List[Prediction]
    data: Published

    @property
    def source(self) -> str:
        return f"estimate:{VERSION}+{self.data.sha256[:8]}"

    def error(self, metric: str, kind: str = "median") -> float:
        errors = np.abs([p.error for p in (self.decode if metric == "decode" else self.ttft) if p.point.use])
        return float(np.median(errors) if kind == "median" else errors.max())


def predict(model: SpeedModel, point: Point, data: Published) -> float:
    return float(_predict_all(model, _Stacked.of([point], data))[0])


@dataclass(frozen=True)
class _Stacked:
    """Points as arrays, for fitting: the features of the graph call each figure times, how many calls, and what
    the figure is (tok/s: 1 / one call; ms: calls x one call)."""

    features: CallFeatures
    calls: np.ndarray
    is_rate: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, points: List[Point], data: Published) -> "_Stacked":
        features = [CallFeatures.of(p.shapes, p.bytes_per_call, data.socs[p.soc], p.ar_len, p.context,
                                    data.runtimes[p.source]) for p in points]
        calls = [1 if p.metric == "decode_tok_s" else math.ceil(p.prompt / p.ar_len) for p in points]
        return cls(CallFeatures.stack(features), np.array(calls, dtype=float),
                   np.array([p.metric == "decode_tok_s" for p in points]), np.array([p.value for p in points]))


def _predict_all(model: SpeedModel, stacked: _Stacked) -> np.ndarray:
    seconds = model.seconds(stacked.features)
    return np.where(stacked.is_rate, 1.0 / seconds, 1000 * stacked.calls * seconds)


def _fit_decode(points: List[Point], data: Published) -> SpeedModel:
    from scipy.optimize import least_squares

    stacked = _Stacked.of(points, data)
    theta = least_squares(lambda t: np.log(_predict_all(SpeedModel(*t), stacked) / stacked.values), DECODE_START,
                          bounds=(0, np.inf)).x
    return SpeedModel(*map(float, theta))


def _fit_prefill(model: SpeedModel, points: List[Point], data: Published) -> SpeedModel:
    from scipy.optimize import least_squares

    stacked = _Stacked.of(points, data)

    def residuals(theta):
        candidate = dataclasses.replace(model, prefill_tops=float(theta[0]))
        return np.log(_predict_all(candidate, stacked) / stacked.values)

    tops = least_squares(residuals, [PREFILL_START], bounds=(1e-3, np.inf)).x[0]
    return dataclasses.replace(model, prefill_tops=float(tops))


def _held_out(points: List[Point], fit_without) -> List[Tuple[Point, Optional[SpeedModel]]]:
    return [(p, fit_without([q for q in points if q is not p and q.use]) if p.use else None) for p in points]


@functools.lru_cache(maxsize=None)
def fitted(path: Optional[str] = None) -> Fit:
    """The model fitted to the data file (default: qexp/speed/published.yaml), with every point's held-out error."""
    data = published(path)
    used_decode = [p for p in data.decode if p.use]
    used_ttft = [p for p in data.ttft if p.use]
    decode_model = _fit_decode(used_decode, data)
    model = _fit_prefill(decode_model, used_ttft, data)

    def predictions(points, fit_without) -> List[Prediction]:
        out = []
        for point, without in _held_out(points, fit_without):
            full = predict(model, point, data)
            out.append(Prediction(point, full, predict(without, point, data) if without is not None else full))
        return out

    decode = predictions(data.decode, lambda pts: _fit_prefill(_fit_decode(pts, data), used_ttft, data))
    ttft = predictions(data.ttft, lambda pts: _fit_prefill(decode_model, pts, data))
    return Fit(model=model, decode=decode, ttft=ttft, data=data)
