"""The loaded float model every stage works from: Meta-layout fp32 weights + params + tokenizer + fingerprint.

Meta layout (the one ExecuTorch's static llama loads, as consolidated.00.pth) is the common form; model families
convert their sources into it (qexp/models/families.py), and model transforms (qexp/transforms) return new
LoadedModels whose fingerprint extends the original's, so every cache key downstream sees the transform.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from qexp.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str
    arch: str
    state_dict: Dict[str, torch.Tensor]  # Meta layout, fp32
    params: dict  # Meta params.json content (dim, n_layers, n_heads, ...)
    tokenizer: Tokenizer
    fingerprint: str  # sha256 of the model file(s), extended by each transform: what a result depends on
    source_path: str
    add_bos: bool
    max_context: Optional[int] = None  # the context length the model was trained for, when known
    hf_dir: Optional[str] = None  # HF folder of the same weights, when there is one (never for a transformed model)
    transforms: Tuple[str, ...] = ()  # names of the transforms applied, in order
    # q/k rows in HF's rotate-half order (Qwen families), not Meta's interleaved order: the static llama uses them as
    # they are instead of permuting them (upstream's transform_weight=False)
    hf_rope_layout: bool = False
    # Exact weight ranges (absmax, [out, n_blocks]) by Meta key, for weights an algorithm already put on the grid
    # (GPTQ): the quantize stage hands them to QnnQuantizer's weight observers instead of re-observing the weights.
    weight_ranges: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_params(self) -> int:
        """Parameters counted once (tied embeddings share storage)."""
        unique = {t.data_ptr(): t.numel() for t in self.state_dict.values()}
        return sum(unique.values())
