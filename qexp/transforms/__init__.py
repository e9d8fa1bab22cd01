"""Model transforms (quantization algorithms acting on the float model): the seam is qexp/transforms/base.py."""

from qexp.transforms.base import (
    TRANSFORMS,
    CalibrationAlgorithm,
    ModelTransform,
    TransformConfig,
    TransformContext,
    algorithm_label,
    build_transforms,
    calibration_algorithms,
    check_fitted_disjoint,
    model_transforms,
    register_transform,
    validate_transforms,
)
from qexp.transforms.apply import apply_transforms

# the algorithms (importing registers them)
from qexp.transforms import awq, gptq, qat, rotation, seq_mse, smoothquant, weight_clip  # noqa: E402,F401

__all__ = ["TRANSFORMS", "CalibrationAlgorithm", "calibration_algorithms", "model_transforms",
           "validate_transforms", "ModelTransform", "TransformConfig", "TransformContext", "algorithm_label",
           "apply_transforms", "build_transforms", "check_fitted_disjoint", "register_transform"]
