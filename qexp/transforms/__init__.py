"""Model transforms (quantization algorithms acting on the float model): the seam is qexp/transforms/base.py."""

from qexp.transforms.base import (
    TRANSFORMS,
    ModelTransform,
    TransformConfig,
    TransformContext,
    apply_transforms,
    build_transforms,
    register_transform,
)

__all__ = ["TRANSFORMS", "ModelTransform", "TransformConfig", "TransformContext", "apply_transforms",
           "build_transforms", "register_transform"]
