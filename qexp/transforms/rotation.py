"""Rotations R1 (residual stream) and R2 (per attention head), QuaRot / SpinQuant without training, fused into the
weights; torchao's SpinQuant code does the fusing (qexp/upstream/private_quantize.py: `spinquant_rotate`).

R1: the norms' weights are folded into the linears that read them, then every weight that writes the residual
stream is multiplied by a random Hadamard matrix Q (and every weight that reads it by Q^T): embeddings, o/down
rows, q/k/v/gate/up/lm-head columns. R2: v's rows and o's columns per head by a head_dim Hadamard. Outliers are
spread over channels, so 4-bit weights (and activations) lose less; the float model keeps its function (R R^T = I),
which `ppl_fp_transformed` shows on every run. SmolLM2's 576 is not a power of two: torchao's random Hadamard
builds it from a 36 x 36 Hadamard block (576 = 36 x 16). R3 (on q/k after RoPE) is the static llama's own switch,
`model.r3`, and composes with this.

torchao's `fuse_layernorm_into_linear` also mean-centres the token embeddings (from SpinQuant's code); that changes
an RMSNorm model's function (measured: 29 dB logits SQNR on a SmolLM2-width model), so qexp keeps the embeddings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qexp.core.errors import ConfigError
from qexp.transforms.base import ModelTransform, TransformConfig, register_transform


@dataclass
class RotationConfig(TransformConfig):
    r1: bool = True
    r2: bool = True
    seed: int = 0  # of the random signs of the Hadamard matrices


@register_transform
class Rotation(ModelTransform):
    name = "rotation"
    config_class = RotationConfig

    def validate(self, cfg) -> None:
        if not (self.config.r1 or self.config.r2):
            raise ConfigError("algorithm.rotation with r1=false and r2=false does nothing", "enable r1 or r2")
        if self.config.r1 and _has_post_norms(cfg.model):
            raise ConfigError(
                f"algorithm.rotation r1 cannot rotate {cfg.model.name}: Gemma's post-attention / post-FFN norms "
                "normalise what the layers write into the residual stream, so R1 would change the model's function",
                "use algorithm.rotation.r1=false (R2 alone preserves it), or another algorithm",
            )

    def apply(self, model, context):
        if self.config.r1 and model.params.get("post_attention_norm"):  # a model whose config did not say so
            raise ConfigError(f"algorithm.rotation r1 cannot rotate {model.name}: it has post-attention norms",
                              "use algorithm.rotation.r1=false (R2 alone preserves its function)")
        from qexp import upstream
        from qexp.models.static_llama import model_args
        from qexp.upstream.private_quantize import spinquant_rotate

        # ExecuTorch's Llama module before its linear -> conv conversion has the gpt-fast names torchao expects
        args = model_args(model, context.cfg.export.max_context_len, context.cfg.export.max_context_len, r3=False)
        module = upstream.LlamaModel(args, ar_len=args.ar_len, output_new_cache_only=True, output_cache=True)
        module.load_state_dict(model.state_dict, strict=True)  # copies: tied embedding / lm head become two tensors
        device = context.device or torch.device("cpu")
        module.to(device)  # its own copies: the float64 products run on the run's device
        spinquant_rotate(module, r1=self.config.r1, r2=self.config.r2, seed=self.config.seed, device=device)
        state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k in model.state_dict}
        return dataclasses.replace(model, state_dict=state)


def _has_post_norms(model_cfg) -> bool:
    """Gemma models (their upstream archs, or the tiny Gemma) normalise attention / MLP outputs before the residual."""
    return str(model_cfg.arch).startswith("gemma") or (model_cfg.source == "tiny" and model_cfg.tiny.family == "gemma3")
