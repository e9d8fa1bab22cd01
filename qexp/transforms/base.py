"""The model-transform seam: a transform maps the loaded float model to another float model.

Quantization algorithms that change weights before quantization (rotations, AWQ / SmoothQuant scale folding, ...)
are transforms. They act on the `LoadedModel` (Meta-layout weights + params + tokenizer), not on a graph, because
every later stage rebuilds its graphs from that model: the QDQ phase's calibration graph, the HTP backend's kv and
prefill graphs, the XNNPACK export. A transform applied here therefore reaches every deployed program, and its
fingerprint extends the model's, so every cache key downstream changes with it. The FP phase always scores the
untransformed model (the reference).

To add one: subclass `ModelTransform` (its `config_class` dataclass holds its settings), implement `apply`,
decorate with `@register_transform`, and add conf/algorithm/<name>.yaml with `<name>: {settings}`.

A second kind of algorithm acts during calibration on the prepared graph instead (SeqMSE's weight-scale search):
`CalibrationAlgorithm`, registered in the same `algorithm` group, run by the quantize stage (qexp/quant/calibrate.py).

Expensive transforms (`cacheable`) keep their result (the tensors they changed, and any exact weight ranges) in the
cache, keyed by the input model, their settings, the calibration data, the weight grid they searched against and
the library versions: a sweep over other axes computes them once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Optional, Tuple, Type

from omegaconf import OmegaConf

from qexp.core.config import NO_QUANT
from qexp.core.errors import ConfigError
from qexp.core.registry import Registry

if TYPE_CHECKING:
    from qexp.cache import Cache
    from qexp.data.calibration import CalibrationSet
    from qexp.models.loaded import LoadedModel
    from qexp.core.timing import StageTimer


@dataclass
class TransformContext:
    """What a transform may use besides the model: calibration data (AWQ, GPTQ, SmoothQuant need activations), the
    run's config (e.g. the quantization grid to search against), the cache, the stage timer."""

    cfg: Any
    calibration: Optional["CalibrationSet"]
    cache: "Cache"
    timer: "StageTimer"
    cache_hits: Dict[str, bool] = dataclasses.field(default_factory=dict)  # transform name -> result from cache
    reference: Optional["LoadedModel"] = None  # the untransformed float model (QAT's teacher)
    reference_static: Any = None  # its static llama as the FP phase built it (a teacher of that length is not copied)
    key: str = ""  # the fingerprint of the transform being applied (what a resumable one names its checkpoint by)
    # transform name -> what the run logs about it (QAT's loss curves, training text, metrics); kept with a cached
    # result, so a cache hit logs the same
    outputs: Dict[str, dict] = dataclasses.field(default_factory=dict)
    # curves while a transform trains ({metric name: [(step, value), ...]} so far): a tracked run logs them as they
    # come; None: nobody watches
    progress: Optional[Callable[[Dict[str, list]], None]] = None
    # where the algorithms compute (the run's `device`, qexp/core/device.py); their results come back as CPU tensors
    device: Any = None


@dataclass
class TransformConfig:
    """Settings every transform has (none yet); subclasses add their own."""


class ModelTransform:
    name: ClassVar[str]
    config_class: ClassVar[Type] = TransformConfig
    needs_calibration: ClassVar[bool] = False
    cacheable: ClassVar[bool] = False  # keep the result in the cache (worth it for minutes of work, not seconds)
    acts_on: ClassVar[str] = "model"  # "model": apply() on the float model; "calibration": see CalibrationAlgorithm
    version: ClassVar[int] = 1  # bump when the code changes what it computes: cached results then stop matching
    # Exact weight scales (LoadedModel.weight_ranges) are only valid for the weights they were chosen for: a transform
    # that sets them must come after every transform that changes weights without reading them (validate_transforms).
    sets_weight_ranges: ClassVar[bool] = False
    uses_weight_ranges: ClassVar[bool] = False  # rounds onto earlier ranges (GPTQ after weight_clip)
    # changes nothing but the linear weights and their exact ranges, choosing them for the low grid (weight clipping,
    # GPTQ): what a sensitivity analysis with low_weights=algorithms takes as the low precision
    rounds_weights: ClassVar[bool] = False
    # computes on the run's device (context.device), so its result's fingerprint carries a CUDA device (CUDA rounds
    # differently); False for one with its own device setting (QAT's `algorithm.qat.device`, in its settings)
    follows_run_device: ClassVar[bool] = True

    def __init__(self, config: Any):
        self.config = config

    def validate(self, cfg) -> None:
        """Reject a config this algorithm cannot serve (scheme, settings), before any work: raise ConfigError."""

    def grid_dependency(self, cfg) -> Dict[str, Any]:
        """What of the run's config besides this transform's settings decides its output (the weight grid it
        searches against, for AWQ / GPTQ); part of its fingerprint."""
        return {}

    def fitted_rows(self, cfg, model: "LoadedModel", cache) -> Optional[Tuple[List[Any], str]]:
        """Token sequences this algorithm fits the model to besides the calibration samples (QAT's training text),
        and what to call one in an error (with `{index}`), so the run can check them against its evaluation windows
        before any work; None when it fits to nothing else."""
        return None

    def fingerprint(self) -> Dict[str, Any]:
        """What determines this transform's output besides the input model (its settings; the calibration data's hash
        is added by `apply_transforms` when it needs calibration). Settings added later are left out at their
        default (provenance.LATER_DEFAULTS), so results cached before they existed stay valid."""
        from qexp.core.provenance import without_later_defaults

        config = OmegaConf.to_container(self.config, resolve=True, enum_to_str=True) if OmegaConf.is_config(
            self.config) else dataclasses.asdict(self.config)
        return {"name": self.name, "version": self.version,
                "config": without_later_defaults(config, ("algorithm", self.name))}

    def label(self) -> str:
        """How tables and the `algorithm` tag name this algorithm: its name, with the settings that differ from its
        defaults, e.g. `weight_clip(objective=outputs)`, so runs of one algorithm with other settings never share a
        row label."""
        config = self.fingerprint()["config"]
        defaults = OmegaConf.to_container(OmegaConf.structured(self.config_class), enum_to_str=True)
        changed = [f"{k}={_setting_text(v)}" for k, v in config.items() if defaults.get(k, object()) != v]
        return f"{self.name}({' '.join(changed)})" if changed else self.name

    def apply(self, model: "LoadedModel", context: TransformContext) -> "LoadedModel":
        """Return the transformed model (a new LoadedModel: `dataclasses.replace(model, state_dict=...)`; leave the
        input untouched, the FP phase and other runs may hold it). The fingerprint is set by the caller."""
        raise NotImplementedError


class CalibrationAlgorithm(ModelTransform):
    """An algorithm that acts on the prepared (observed) graph during calibration, not on the float model."""

    acts_on = "calibration"

    def calibrate(self, prepared, static, calibration, device) -> None:
        """Run after the first calibration sample, with the prepared graph on `device` (its inputs go there);
        leaves its result in the graph's observers."""
        raise NotImplementedError


class GridSearchTransform(ModelTransform):
    """A calibrated, cached transform that searches against the run's weight grid (AWQ, GPTQ): it needs a weight-
    quantized scheme, and the grid is part of its fingerprint."""

    needs_calibration = True
    cacheable = True
    needs_grid_because: ClassVar[str] = "searches against a quantization grid"

    def validate(self, cfg) -> None:
        if cfg.quant.scheme == NO_QUANT:
            raise ConfigError(f"algorithm {self.name} {self.needs_grid_because}, and quant=fp32 has none",
                              "choose a weight-quantized scheme, e.g. quant=16a4w")
        refuse_two_bit_weights(cfg, self.name)

    def grid_dependency(self, cfg) -> Dict[str, Any]:
        """What in the quant config decides the weight grids."""
        q = cfg.quant
        return {"scheme": q.scheme, "weight_granularity": str(q.weight_granularity), "block_size": q.block_size,
                "block_scale_rounding": str(q.block_scale_rounding),
                "overrides": [(o.pattern, o.scheme, str(o.granularity), o.block_size) for o in q.overrides]}


def refuse_two_bit_weights(cfg, name: str) -> None:
    """qexp's weight algorithms search symmetric grids [-qmax, qmax]; QnnQuantizer's 2-bit weights are [-2, 1] (four
    codes, scale absmax / 1.5), which no algorithm here models."""
    from qexp.quant.grid import weight_bits

    schemes = [cfg.quant.scheme, *(o.scheme for o in cfg.quant.overrides)]
    if any(weight_bits(s) == 2 for s in schemes if s != NO_QUANT):
        raise ConfigError(f"algorithm {name} searches a symmetric weight grid, and 16a2w's 2-bit weights are the "
                          "asymmetric codes [-2, 1]", "use quant=16a2w with round to nearest (algorithm=[]) or "
                          "with rotation only (algorithm=[rotation])")


def _setting_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def algorithm_label(transforms: List[ModelTransform]) -> str:
    """The `algorithm` tag: the algorithms in order, each with its non-default settings ("" for none)."""
    return ",".join(t.label() for t in transforms)


TRANSFORMS: Registry[Type[ModelTransform]] = Registry("algorithm")


def register_transform(cls: Type[ModelTransform]) -> Type[ModelTransform]:
    return TRANSFORMS.add(cls.name, cls)


def build_transforms(algorithm_cfg) -> List[ModelTransform]:
    """The transforms selected by the `algorithm` config (a mapping name -> settings, in application order), each
    with its settings validated against its config dataclass."""
    transforms = []
    for name, settings in (algorithm_cfg or {}).items():
        if name not in TRANSFORMS:
            known = ", ".join(sorted(TRANSFORMS)) or "none registered yet"
            raise ConfigError(f"unknown algorithm {name!r}", f"choose from: {known}")
        cls = TRANSFORMS[name]
        schema = OmegaConf.structured(cls.config_class)
        try:
            if OmegaConf.is_config(settings):  # resolved in the run's config (algorithm.qat.device: ${device})
                settings = OmegaConf.to_container(settings, resolve=True)
            config = OmegaConf.merge(schema, settings or {})
        except Exception as exc:  # noqa: BLE001 - OmegaConf raises several types for a bad value or key
            raise ConfigError(f"algorithm.{name}: {str(exc).splitlines()[0]}", "see docs/algorithms.md") from exc
        transforms.append(cls(config))
    return transforms


def check_fitted_disjoint(transforms: List[ModelTransform], cfg, model: "LoadedModel", cache, windows) -> None:
    """What the algorithms fit the model to besides the calibration samples (QAT's training text) shares no long
    token run with the evaluation windows, checked as calibration samples are, before any of them runs."""
    from qexp.data.calibration import check_rows_disjoint

    for transform in transforms:
        fitted = transform.fitted_rows(cfg, model, cache)
        if fitted is not None:
            check_rows_disjoint(fitted[0], windows, fitted[1], "score fewer windows (eval.limit) or train on another "
                                "text's calibration half (calibration.text)")


def validate_transforms(cfg, transforms: Optional[List[ModelTransform]] = None) -> List[ModelTransform]:
    """cfg.algorithm's transforms (`transforms` when already built from it), each checked against the whole config,
    and their order and combination."""
    transforms = build_transforms(cfg.algorithm) if transforms is None else transforms
    for transform in transforms:
        transform.validate(cfg)
    ranges_from = None
    for transform in model_transforms(transforms):
        if ranges_from is not None and not transform.uses_weight_ranges:
            raise ConfigError(f"algorithm order: {transform.name} after {ranges_from} would not keep the weight "
                              f"scales {ranges_from} chose",
                              f"put {ranges_from} after {transform.name}, e.g. algorithm=[rotation,weight_clip,gptq]")
        if transform.sets_weight_ranges:
            ranges_from = transform.name
    for algorithm in calibration_algorithms(transforms):  # the handed-over ranges are set after calibration
        if ranges_from is not None:
            raise ConfigError(f"algorithm {algorithm.name} searches weight scales, and {ranges_from} already fixed "
                              "them (its scales would replace the search's)", f"use one of {algorithm.name} and "
                              f"{ranges_from}")
    return transforms


def model_transforms(transforms: List[ModelTransform]) -> List[ModelTransform]:
    return [t for t in transforms if t.acts_on == "model"]


def calibration_algorithms(transforms: List[ModelTransform]) -> List[CalibrationAlgorithm]:
    return [t for t in transforms if t.acts_on == "calibration"]
