"""Fitting the speed model to the published figures, and its held-out errors.

Decode parameters (bandwidth efficiency, its growth with the NPU generation, the per-head-op cost, the KV cache's
extra cost, Genie's speed-up over ExecuTorch's runner) are fitted to every decode point with `use: true`, in log
space (relative errors: a 20 tok/s model and a 250 tok/s one weigh alike); the prefill compute rate is then fitted
to the TTFT points. A CI floor is a lower bound: its residual is zero wherever the model predicts at or above it (a
censored loss), so floors never pull the model down to them.

Each point is also predicted by fits that never saw it: without the point (leave-one-point-out), without every
point of its model (leave-one-model-out: the error a model nobody has timed should expect) and without every point
of its source. The estimate's interval is the 10-90% band of the leave-one-model-out errors of the measured points."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from qexp.speed.data import Point, Published, published
from qexp.speed.model import VERSION, CallFeatures, SpeedModel

DECODE_START = (0.5, 0.5, 0.3, 1.5, 1.0)  # bandwidth_efficiency, compute_exponent, head_op_us, kv_extra, genie_speedup
DECODE_PARAMETERS = ("bandwidth_efficiency", "compute_exponent", "head_op_us", "kv_extra", "genie_speedup")
PREFILL_START = 10.0
# The form the product uses: v3's extra cost of each KV-cache read per query head held at 0. With the published
# figures' labels corrected it explained little (0.42 -> 0.23) and worsened the leave-one-model-out error
# (benchmarks/bench_speed_model.py prints the forms side by side).
PRODUCT_FORM = (("kv_extra", 0.0),)
HOLD_OUTS = ("point", "model", "source")  # what a held-out prediction leaves out of the fit
BAND = (0.1, 0.9)  # the estimate's interval: these quantiles of the leave-one-model-out errors


@dataclass(frozen=True)
class Prediction:
    point: Point
    predicted: float  # by the model fitted on every point
    held_out: float  # by the model fitted without this point (the same for a point not used in the fit)
    held_out_model: float  # ... without every point of this point's model
    held_out_source: float  # ... without every point of this point's source

    @property
    def error(self) -> float:
        return self.error_of("point")

    def error_of(self, hold_out: str) -> float:
        value = {"point": self.held_out, "model": self.held_out_model, "source": self.held_out_source}[hold_out]
        return value / self.point.value - 1

    def below_floor(self, hold_out: str = "point") -> float:
        """How far below its floor a floor is predicted (a negative fraction), 0 at or above it or for a measurement."""
        return min(self.error_of(hold_out), 0.0) if self.point.is_floor else 0.0


@dataclass(frozen=True)
class Fit:
    model: SpeedModel
    decode: List[Prediction]
    ttft: List[Prediction]
    data: Published

    @property
    def source(self) -> str:
        return f"estimate:{VERSION}+{self.data.sha256[:8]}"

    def measured(self, metric: str) -> List[Prediction]:
        return [p for p in (self.decode if metric == "decode" else self.ttft) if p.point.use and not p.point.is_floor]

    def error(self, metric: str, kind: str = "median", hold_out: str = "point") -> float:
        """The median (or worst) absolute held-out error over the fitted measurements (floors are bounds: see
        floor_misses)."""
        errors = np.abs([p.error_of(hold_out) for p in self.measured(metric)])
        return float(np.median(errors) if kind == "median" else errors.max())

    def floor_misses(self, hold_out: str = "point") -> List[Prediction]:
        return [p for p in self.decode if p.point.use and p.below_floor(hold_out) < 0]

    def band(self, metric: str) -> Tuple[float, float]:
        """(low, high) factors on an estimate: the 10-90% band of the held-out ratios (leave-one-model-out for
        decode; the TTFT points are too few for quantiles, so their whole leave-one-point-out range)."""
        if metric == "decode":
            ratios = np.array([1 + p.error_of("model") for p in self.measured("decode")])
            low_ratio, high_ratio = np.quantile(ratios, BAND)
        else:
            ratios = np.array([1 + p.error for p in self.measured("ttft")])
            low_ratio, high_ratio = ratios.min(), ratios.max()
        # a prediction `ratio` times the truth: the truth lies between estimate / high_ratio and estimate / low_ratio
        return float(1 / high_ratio), float(1 / low_ratio)


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
    is_floor: np.ndarray

    @classmethod
    def of(cls, points: List[Point], data: Published) -> "_Stacked":
        features = [CallFeatures.of(p.shapes, p.bytes_per_call, data.socs[p.soc], p.ar_len, p.context,
                                    data.runtimes[p.source]) for p in points]
        calls = [1 if p.metric == "decode_tok_s" else math.ceil(p.prompt / p.ar_len) for p in points]
        return cls(CallFeatures.stack(features), np.array(calls, dtype=float),
                   np.array([p.metric == "decode_tok_s" for p in points]), np.array([p.value for p in points]),
                   np.array([p.is_floor for p in points]))

    def residuals(self, predicted: np.ndarray) -> np.ndarray:
        log_ratio = np.log(predicted / self.values)
        # a floor of a rate is missed by predicting below it (of a time: above it); otherwise it costs nothing
        floor_miss = np.where(self.is_rate, np.minimum(log_ratio, 0), np.maximum(log_ratio, 0))
        return np.where(self.is_floor, floor_miss, log_ratio)


def _predict_all(model: SpeedModel, stacked: _Stacked) -> np.ndarray:
    seconds = model.seconds(stacked.features)
    return np.where(stacked.is_rate, 1.0 / seconds, 1000 * stacked.calls * seconds)


def fit_decode(points: List[Point], data: Published, pinned: Optional[Dict[str, float]] = None) -> SpeedModel:
    """The decode parameters fitted to `points`; `pinned` holds parameters at given values (a simpler form)."""
    from scipy.optimize import least_squares

    pinned = pinned or {}
    free = [i for i, name in enumerate(DECODE_PARAMETERS) if name not in pinned]
    stacked = _Stacked.of(points, data)

    def model_of(theta) -> SpeedModel:
        values = [pinned.get(name, 0.0) for name in DECODE_PARAMETERS]
        for i, value in zip(free, theta):
            values[i] = value
        return SpeedModel(*values)

    theta = least_squares(lambda t: stacked.residuals(_predict_all(model_of(t), stacked)),
                          [DECODE_START[i] for i in free], bounds=(0, np.inf)).x
    return model_of([float(t) for t in theta])


def _fit_prefill(model: SpeedModel, points: List[Point], data: Published) -> SpeedModel:
    from scipy.optimize import least_squares

    stacked = _Stacked.of(points, data)

    def residuals(theta):
        return stacked.residuals(_predict_all(dataclasses.replace(model, prefill_tops=float(theta[0])), stacked))

    tops = least_squares(residuals, [PREFILL_START], bounds=(1e-3, np.inf)).x[0]
    return dataclasses.replace(model, prefill_tops=float(tops))


def _group(point: Point, hold_out: str) -> str:
    return {"point": point.name, "model": point.model, "source": point.source}[hold_out]


def _held_out(points: List[Point], fit_without: Callable, hold_out: str, data: Published) -> Dict[int, float]:
    """Each point's prediction by the fit without its group (a group with every fitted point: the full fit's)."""
    used = [p for p in points if p.use]
    fits: Dict[str, SpeedModel] = {}
    out = {}
    for i, point in enumerate(points):
        if not point.use:  # the fit never saw it: the full fit's prediction is already held out
            continue
        group = _group(point, hold_out)
        rest = [q for q in used if _group(q, hold_out) != group]
        if not rest:
            continue
        if group not in fits:
            fits[group] = fit_without(rest)
        out[i] = predict(fits[group], point, data)
    return out


@functools.lru_cache(maxsize=None)
def fitted(path: Optional[str] = None, pinned: Tuple[Tuple[str, float], ...] = PRODUCT_FORM) -> Fit:
    """The model fitted to the data file (default: qexp/speed/published.yaml), with every point's held-out
    predictions; `pinned` ((name, value), ...) holds decode parameters (the product's form by default)."""
    data = published(path)
    used_decode = [p for p in data.decode if p.use]
    used_ttft = [p for p in data.ttft if p.use]
    decode_model = fit_decode(used_decode, data, dict(pinned))
    model = _fit_prefill(decode_model, used_ttft, data)

    def predictions(points, fit_without) -> List[Prediction]:
        held = {h: _held_out(points, fit_without, h, data) for h in HOLD_OUTS}
        out = []
        for i, point in enumerate(points):
            full = predict(model, point, data)
            out.append(Prediction(point, full, *(held[h].get(i, full) if point.use else full for h in HOLD_OUTS)))
        return out

    decode = predictions(data.decode,
                         lambda pts: _fit_prefill(fit_decode(pts, data, dict(pinned)), used_ttft, data))
    ttft = predictions(data.ttft, lambda pts: _fit_prefill(decode_model, pts, data))
    return Fit(model=model, decode=decode, ttft=ttft, data=data)
