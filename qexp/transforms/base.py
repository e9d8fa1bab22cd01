"""The model-transform seam: a transform maps the loaded float model to another float model.

Quantization algorithms that change weights before quantization (rotations, AWQ / SmoothQuant scale folding, ...)
are transforms. They act on the `LoadedModel` (Meta-layout weights + params + tokenizer), not on a graph, because
every later stage rebuilds its graphs from that model: the QDQ phase's calibration graph, the HTP backend's kv and
prefill graphs, the XNNPACK export. A transform applied here therefore reaches every deployed program, and its
fingerprint extends the model's, so every cache key downstream changes with it. The FP phase always scores the
untransformed model (the reference).

To add one: subclass `ModelTransform` (its `config_class` dataclass holds its settings), implement `apply`,
decorate with `@register_transform`, and add conf/algorithm/<name>.yaml with `<name>: {settings}`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Type

from omegaconf import OmegaConf

from qexp.cache import stable_hash
from qexp.errors import ConfigError

if TYPE_CHECKING:
    from qexp.cache import Cache
    from qexp.data.calibration import CalibrationSet
    from qexp.models.loaded import LoadedModel
    from qexp.timing import StageTimer


@dataclass
class TransformContext:
    """What a transform may use besides the model: calibration data (AWQ, GPTQ, SmoothQuant need activations), the
    run's config (e.g. the quantization grid to search against), the cache, the stage timer."""

    cfg: Any
    calibration: Optional["CalibrationSet"]
    cache: "Cache"
    timer: "StageTimer"


@dataclass
class TransformConfig:
    """Settings every transform has (none yet); subclasses add their own."""


class ModelTransform:
    name: ClassVar[str]
    config_class: ClassVar[Type] = TransformConfig
    needs_calibration: ClassVar[bool] = False

    def __init__(self, config: Any):
        self.config = config

    def fingerprint(self) -> Dict[str, Any]:
        """What determines this transform's output besides the input model (its settings; the calibration data's hash
        is added by `apply_transforms` when it needs calibration)."""
        config = OmegaConf.to_container(self.config, resolve=True, enum_to_str=True) if OmegaConf.is_config(
            self.config) else dataclasses.asdict(self.config)
        return {"name": self.name, "config": config}

    def apply(self, model: "LoadedModel", context: TransformContext) -> "LoadedModel":
        """Return the transformed model (a new LoadedModel: `dataclasses.replace(model, state_dict=...)`; leave the
        input untouched, the FP phase and other runs may hold it). The fingerprint is set by the caller."""
        raise NotImplementedError


TRANSFORMS: Dict[str, Type[ModelTransform]] = {}


def register_transform(cls: Type[ModelTransform]) -> Type[ModelTransform]:
    TRANSFORMS[cls.name] = cls
    return cls


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
            config = OmegaConf.merge(schema, settings or {})
        except Exception as exc:  # noqa: BLE001 - OmegaConf raises several types for a bad value or key
            raise ConfigError(f"algorithm.{name}: {str(exc).splitlines()[0]}", "see conf/algorithm/README.md") from exc
        transforms.append(cls(config))
    return transforms


def apply_transforms(model: "LoadedModel", transforms: List[ModelTransform],
                     context: TransformContext) -> "LoadedModel":
    """Apply `transforms` in order; each result's fingerprint is the hash of its input's and the transform's."""
    for transform in transforms:
        key = transform.fingerprint()
        if transform.needs_calibration:
            if context.calibration is None:
                raise ConfigError(f"algorithm {transform.name} needs calibration data",
                                  "use a quantized scheme (quant=...) with a calibration set")
            key["calibration"] = context.calibration.sha256
        with context.timer.stage(f"transform_{transform.name}"):
            transformed = transform.apply(model, context)
        model = dataclasses.replace(transformed, fingerprint=stable_hash([model.fingerprint, key], length=64),
                                    hf_dir=None, transforms=(*model.transforms, transform.name))
    return model
