"""The run's model transforms applied in order: each result's fingerprint chains its input's with the transform's
settings, calibration data, grid and device, and a cacheable transform's result is stored (only the tensors it
changed) under that fingerprint."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List

from qexp.cache import stable_hash
from qexp.core.errors import ConfigError
from qexp.transforms.base import ModelTransform, TransformContext, model_transforms

if TYPE_CHECKING:
    from qexp.models.loaded import LoadedModel


def apply_transforms(model: "LoadedModel", transforms: List[ModelTransform],
                     context: TransformContext) -> "LoadedModel":
    """Apply the model transforms in order; each result's fingerprint is the hash of its input's and the
    transform's (settings, calibration data, grid, and a CUDA device)."""
    from qexp.core.device import device_key

    for transform in model_transforms(transforms):
        key = {**transform.fingerprint(), **transform.grid_dependency(context.cfg)}
        if transform.needs_calibration:
            if context.calibration is None or not context.calibration.samples:
                raise ConfigError(f"algorithm {transform.name} needs calibration data and has none",
                                  "use a calibration set with samples (calibration.limit >= 1)")
            key["calibration"] = context.calibration.sha256
        if transform.follows_run_device and context.device is not None:
            key.update(device_key(context.device))  # nothing for the CPU: fingerprints from before stay valid
        fingerprint = stable_hash([model.fingerprint, key], length=64)
        context.key = fingerprint
        with context.timer.stage(f"transform_{transform.name}"):
            if transform.cacheable:
                transformed = _cached_apply(transform, model, context, fingerprint)
            else:
                transformed = transform.apply(model, context)
        model = dataclasses.replace(transformed, fingerprint=fingerprint, hf_dir=None,
                                    transforms=(*model.transforms, transform.name))
    return model


TRANSFORM_CACHE_VERSION = 1


def _cached_apply(transform: ModelTransform, model: "LoadedModel", context: TransformContext,
                  fingerprint: str) -> "LoadedModel":
    """The transform's result from the cache, else computed and stored: only the tensors it changed (and its exact
    weight ranges); an entry is complete or absent (a failing transform leaves nothing)."""
    import torch

    from qexp.core.provenance import library_versions, numerics_key

    key = stable_hash({"version": TRANSFORM_CACHE_VERSION, "fingerprint": fingerprint, "numerics": numerics_key(),
                       "versions": library_versions()}, length=24)
    computed = {}

    def build(tmp):
        result = transform.apply(model, context)
        changed = {k: v.contiguous() for k, v in result.state_dict.items() if v is not model.state_dict.get(k)}
        torch.save({"state_dict": changed, "weight_ranges": dict(result.weight_ranges),
                    "outputs": context.outputs.get(transform.name)}, tmp / "transform.pt")
        computed["model"] = result
        return {"transform": transform.name, "changed_tensors": len(changed)}

    path, hit = context.cache.get_or_build("transform", key, build)
    context.cache_hits[transform.name] = hit
    if not hit:
        return computed["model"]
    saved = torch.load(path / "transform.pt", weights_only=True, mmap=True)
    if saved.get("outputs") is not None:
        context.outputs[transform.name] = saved["outputs"]
    return dataclasses.replace(model, state_dict={**model.state_dict, **saved["state_dict"]},
                               weight_ranges=saved["weight_ranges"])
