"""The one place qexp imports ExecuTorch's Qualcomm LLM example code (static llama, recipes, masks).

Private upstream APIs (underscored names, `_passes`, monkeypatches) are wrapped in qexp/upstream/private.py
(lowering, export), private_quantize.py and private_runtime.py.

That code lives in `executorch.examples.qualcomm.oss_scripts.llama`, whose package __init__ imports every
registered model's weight converter. Two of those import `torchtune`, and torchtune 0.6.1 does not import with
torchao 0.18. qexp never calls those two converters, so before importing upstream it registers a named import shim
for the two torchtune names they reference; calling either raises. (Qwen2.5's converter is one of them: qexp reuses
its name mapping with ExecuTorch's own get_mapped_key, see the bottom of this file.)
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings


def _install_torchtune_import_shim() -> None:
    try:  # a working torchtune, if someone has one, wins
        import torchtune.models.convert_weights  # noqa: F401
        import torchtune.training  # noqa: F401

        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchtune" or m.startswith("torchtune.")]:
            del sys.modules[name]

    def unavailable(*_args, **_kwargs):
        raise RuntimeError("torchtune is not importable here; qexp converts checkpoints itself")

    root = types.ModuleType("torchtune")
    models = types.ModuleType("torchtune.models")
    convert_weights = types.ModuleType("torchtune.models.convert_weights")
    training = types.ModuleType("torchtune.training")
    convert_weights.get_mapped_key = unavailable
    training.FullModelHFCheckpointer = unavailable
    root.models, models.convert_weights, root.training = models, convert_weights, training
    root.__qexp_shim__ = True
    sys.modules.update(
        {
            "torchtune": root,
            "torchtune.models": models,
            "torchtune.models.convert_weights": convert_weights,
            "torchtune.training": training,
        }
    )


def prepare_import() -> None:
    """Make upstream importable offline and quiet. Idempotent."""
    # Without QNN_SDK_ROOT, importing the Qualcomm quantizer tries to download an SDK (fails offline after a
    # timeout). Empty means "quantize only"; the HTP backend sets a real root before lowering.
    os.environ.setdefault("QNN_SDK_ROOT", "")
    # Harmless noise on import: torchao's optional CUDA kernels, pytree enum registration.
    warnings.filterwarnings("ignore", message=".*is an Enum subclass.*")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    _install_torchtune_import_shim()
    from qexp.upstream.private_quantize import speed_up_prepare

    speed_up_prepare()


prepare_import()

# Re-exported upstream names used across qexp (import them from here, not from executorch directly).
from executorch.backends.qualcomm.quantizer import custom_annotation  # noqa: E402
from executorch.backends.qualcomm.quantizer.quant_recipe import QuantGranularity, QuantRecipe  # noqa: E402
from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype  # noqa: E402
from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset  # noqa: E402
from executorch.backends.qualcomm.utils.utils import convert_linear_to_conv2d  # noqa: E402
from executorch.examples.models.checkpoint import get_mapped_key  # noqa: E402
from executorch.examples.models.llama.model_args import ModelArgs  # noqa: E402
from executorch.examples.qualcomm.oss_scripts.llama import SUPPORTED_LLM_MODELS  # noqa: E402
from executorch.examples.qualcomm.oss_scripts.llama.masking_utils import (  # noqa: E402
    AttentionMask,
    CausalAttentionMask,
)
from executorch.examples.qualcomm.oss_scripts.llama.model.static_llama import (  # noqa: E402
    LlamaModel,
    MultiScopeAwareLlamaModel,  # Gemma 2/3: sliding-window layers with their own RoPE table and mask
)

# HF -> Meta weight converters of the model families (qexp/models/qwen.py). Qwen3's function is callable; Qwen2.5's
# (`qwen_2_5_hf_to_meta`) calls torchtune's get_mapped_key, which the shim above makes raise, so qexp applies its
# name mapping (a module-level dict, underscored upstream) with ExecuTorch's own get_mapped_key instead.
from executorch.examples.models.qwen2_5.convert_weights import _QWEN_2_5_FROM_META as QWEN_2_5_FROM_META  # noqa: E402
from executorch.examples.models.qwen3.convert_weights import qwen_3_tune_to_meta  # noqa: E402
from executorch.examples.models.gemma3.convert_weights import gemma3_to_executorch  # noqa: E402

# qexp's own messages go through the "qexp" logger; upstream's modules configure the root logger at INFO on
# import (llama.py), which we leave alone but do not rely on.
__all__ = [
    "AttentionMask",
    "CausalAttentionMask",
    "LlamaModel",
    "ModelArgs",
    "MultiScopeAwareLlamaModel",
    "QWEN_2_5_FROM_META",
    "QcomChipset",
    "QnnQuantizer",
    "QuantDtype",
    "QuantGranularity",
    "QuantRecipe",
    "SUPPORTED_LLM_MODELS",
    "convert_linear_to_conv2d",
    "custom_annotation",
    "gemma3_to_executorch",
    "get_mapped_key",
    "qwen_3_tune_to_meta",
]
