"""ExecuTorch's static llama (the graph upstream compiles for HTP), built from a LoadedModel.

qexp uses it in upstream's calibration form: ar_len = max_context_len, so one forward call scores a whole window
of up to max_context_len tokens. The FP phase runs this module eagerly, and the quantize stage exports and
calibrates exactly this module, so the phases differ only by quantization. Later stages re-export the same
weights with other AR lengths (kv / prefill graphs) and copy the calibrated encodings onto them, as upstream does.
"""

from __future__ import annotations

import logging
from typing import Sequence, Tuple

import torch

from qexp import upstream
from qexp.core.errors import ConfigError, InputError
from qexp.models.loaded import LoadedModel

log = logging.getLogger("qexp")


def arch_flags(arch: str) -> dict:
    """Architecture switches upstream registers per model (SUPPORTED_LLM_MODELS)."""
    if arch not in upstream.SUPPORTED_LLM_MODELS:
        raise ConfigError(
            f"model.arch={arch!r} is not an ExecuTorch-registered static llama",
            f"choose one of: {', '.join(sorted(upstream.SUPPORTED_LLM_MODELS))}",
        )
    config = upstream.SUPPORTED_LLM_MODELS[arch]
    return {
        "transform_weight": bool(config.transform_weight),
        "r3": bool(config.r3),
        "masked_softmax": bool(config.masked_softmax),
    }


def uses_masked_softmax(model_cfg) -> bool:
    """Whether this model config's static llama uses upstream's masked softmax (model.masked_softmax, else upstream's
    value for the arch)."""
    value = model_cfg.masked_softmax
    return arch_flags(model_cfg.arch)["masked_softmax"] if value is None else bool(value)


def uses_r3(model_cfg) -> bool:
    """Whether the static llama of this model config applies SpinQuant's R3 rotation (model.r3, else upstream's)."""
    return arch_flags(model_cfg.arch)["r3"] if model_cfg.r3 is None else bool(model_cfg.r3)


def _rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Upstream's `transform_weight` (TextDecoder._prepare_model) for one q/k weight: Meta interleaved rows -> the
    rotate-half layout the static llama's RoPE expects on HTP. Kept equal to upstream's permute with
    partial_rotary_dim=1."""
    rows, cols = w.shape
    return w.view(heads, -1, rows // heads // 2, 2, cols).transpose(2, 3).reshape(rows, cols)


def _rope_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_rope_permute`: rotate-half rows -> Meta's interleaved order."""
    rows, cols = w.shape
    return w.view(heads, -1, 2, rows // heads // 2, cols).transpose(2, 3).reshape(rows, cols)


def _to_rope_layout(state_dict: dict, n_layers: int, n_heads: int, n_kv_heads: int) -> dict:
    out = dict(state_dict)
    for i in range(n_layers):
        out[f"layers.{i}.attention.wq.weight"] = _rope_permute(out[f"layers.{i}.attention.wq.weight"], n_heads)
        out[f"layers.{i}.attention.wk.weight"] = _rope_permute(out[f"layers.{i}.attention.wk.weight"], n_kv_heads)
    return out


def _share_conv_weights(owner: torch.nn.Module, linears: dict) -> None:
    """Upstream's conv preparation copies each linear's weight into a new 1x1 conv; point the conv at the linear's
    tensor instead (a [out, in, 1, 1] view of it), so the static llama shares its weights with the LoadedModel it was
    built from, as the code around it assumes (StaticLlama.private_copy copies before updating in
    place), and a 1B model's decoder is held once, not twice (3.9 GB of Llama-3.2-1B's shape)."""
    for name, linear in linears.items():
        conv = getattr(owner, f"{name}_conv", None)
        if not isinstance(conv, torch.nn.Conv2d) or conv.weight.shape != (*linear.weight.shape, 1, 1):
            continue  # e.g. a fused gate/up conv: a copy of two linears, kept as upstream built it
        conv.weight = torch.nn.Parameter(linear.weight.detach()[:, :, None, None], conv.weight.requires_grad)
        if conv.bias is not None and linear.bias is not None and conv.bias.shape == linear.bias.shape:
            conv.bias = torch.nn.Parameter(linear.bias.detach(), conv.bias.requires_grad)


def model_args(model: LoadedModel, max_context_len: int, ar_len: int, r3: bool, kv_io_bit_width: int = 16,
               masked_softmax: bool = False):
    """upstream ModelArgs as its process_model_args sets them (batch 1)."""
    args = upstream.ModelArgs(**model.params)
    args.max_batch_size = 1
    args.max_seq_len = max_context_len
    args.max_context_len = max_context_len
    args.ar_len = ar_len
    args.use_kv_cache = True  # upstream: always for the calibration graph, and whenever ar_len != context
    args.enable_r3 = r3
    args.kv_io_bit_width = kv_io_bit_width
    # Upstream enables it after checking the QNN SDK is >= 2.35; qexp's libraries are QNN 2.49 (pinned).
    args.enable_masked_softmax = masked_softmax
    return args


class StaticLlama:
    """The static llama for one context length, with helpers to build its flat input tuple."""

    def __init__(self, model: LoadedModel, max_context_len: int, r3: bool | None = None, ar_len: int | None = None,
                 masked_softmax: bool = False):
        flags = arch_flags(model.arch)
        # Upstream's transform_weight says its converter left q/k in Meta's interleaved order, to be permuted to the
        # rotate-half order the static llama's RoPE uses. In qexp the model family decides that order, so the
        # permutation follows the weights (llama family, Meta checkpoints: yes; Qwen: no), not the arch.
        self.transform_weight = not model.hf_rope_layout
        self.r3 = flags["r3"] if r3 is None else bool(r3)
        self.max_context_len = max_context_len
        self.ar_len = ar_len or max_context_len
        self.masked_softmax = bool(masked_softmax)
        self.args = model_args(model, max_context_len, self.ar_len, self.r3, masked_softmax=self.masked_softmax)
        # Upstream picks the class per registered model (LLM_VARIANT_ARCHS); qexp by what the params describe:
        # sliding-window layers (Gemma 3) need the multi-scope model's second RoPE table and second mask input.
        model_class = upstream.MultiScopeAwareLlamaModel if self.args.layer_types else upstream.LlamaModel
        module = model_class(self.args, ar_len=self.ar_len, output_new_cache_only=True, output_cache=True)
        self.n_masks = 2 if self.args.layer_types else 1
        state = model.state_dict
        if self.transform_weight:
            state = _to_rope_layout(state, self.args.n_layers, self.args.n_heads, self.args.n_kv_heads)
        # strict: a checkpoint that does not fit the params (wrong file pairing) fails here, loudly.
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise InputError(
                f"checkpoint does not match its params ({str(exc).splitlines()[0][:160]})",
                "check that model.checkpoint and model.params belong together",
            ) from exc
        for layer in module.layers:  # upstream's linear -> 1x1 conv preparation for HTP
            for owner, prepare in ((layer.attention, "prepare_attention_conv"),
                                   (layer.feed_forward, "prepare_feedforward_conv")):
                if getattr(owner, prepare, None):
                    linears = {n: m for n, m in owner.named_children() if isinstance(m, torch.nn.Linear)}
                    getattr(owner, prepare)()
                    _share_conv_weights(owner, linears)
        self.module = upstream.convert_linear_to_conv2d(module).eval()
        self.n_layers = self.args.n_layers
        # exact weight ranges an algorithm fixed (GPTQ), by this module's parameter name, rows in its order
        self.weight_ranges = dict(self.static_layout(k, v) for k, v in model.weight_ranges.items())
        self.vocab_size = self.args.vocab_size

    @classmethod
    def for_model_config(cls, model: LoadedModel, max_context_len: int, model_cfg) -> "StaticLlama":
        """The static llama with the run's architecture switches (model.r3, model.masked_softmax): the graph every
        CPU phase and algorithm of a run uses."""
        return cls(model, max_context_len, r3=model_cfg.r3, masked_softmax=uses_masked_softmax(model_cfg))

    @classmethod
    def private_copy(cls, model: LoadedModel, max_context_len: int, model_cfg) -> "StaticLlama":
        """for_model_config on a private copy of the weights: the StaticLlama shares its tensors with the LoadedModel
        it is built from, and layer-by-layer algorithms update the module in place."""
        import dataclasses

        state = {k: v.detach().clone() for k, v in model.state_dict.items()}
        return cls.for_model_config(dataclasses.replace(model, state_dict=state), max_context_len, model_cfg)

    def static_layout(self, key: str, value: torch.Tensor) -> Tuple[str, torch.Tensor]:
        """A Meta-layout per-row tensor (a linear's weight, or its per-row ranges) -> (this module's parameter name,
        the rows in this module's order): q/k rows go to the RoPE layout when the arch uses it."""
        from qexp.models.shapes import static_module_path

        if self.transform_weight and key.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = self.args.n_heads if key.endswith("wq.weight") else self.args.n_kv_heads
            value = _rope_permute(value, heads)
        return static_module_path(key) + ".weight", value

    def meta_layout(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """The inverse of `static_layout` for the Meta key `key`: this module's tensor (a conv weight [out, in, 1, 1],
        or per-row ranges) -> Meta layout ([out, in], q/k rows back in Meta's order when the arch permuted them)."""
        value = value.reshape(value.shape[0], -1)
        if self.transform_weight and key.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = self.args.n_heads if key.endswith("wq.weight") else self.args.n_kv_heads
            value = _rope_unpermute(value, heads)
        return value

    @torch.no_grad()
    def update_weights(self, updates: dict) -> None:
        """Copy Meta-layout tensors (`layers.0.attention.wq.weight`, `layers.0.ffn_norm.weight`, ...) into this
        module in place. Algorithms that work layer by layer (GPTQ, AWQ) use it to run the next layer's calibration
        on the already-updated ones."""
        params = dict(self.module.named_parameters())
        for key, value in updates.items():
            if key in params:
                params[key].copy_(value)
                continue
            name, value = self.static_layout(key, value)
            params[name].copy_(value.reshape(params[name].shape))

    def inputs(self, tokens: Sequence[int] | torch.Tensor, start_pos: int = 0) -> Tuple[torch.Tensor, ...]:
        """Flat inputs (tokens, mask, positions, k caches..., v caches...) for up to ar_len tokens.

        Shorter inputs are right-padded; with the causal mask, padding cannot change the real positions' logits.
        Positions must be real (arange): upstream's example inputs use zeros, which silently disables RoPE.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.int32).reshape(-1)
        n = tokens.numel()
        if n == 0 or n > self.ar_len:
            raise ValueError(f"{n} tokens for a graph of AR length {self.ar_len}")
        padded = torch.zeros((1, self.ar_len), dtype=torch.int32)
        padded[0, :n] = tokens
        example = self.module.get_example_inputs()
        _, mask, _, k_caches, v_caches = example
        positions = (start_pos + torch.arange(self.ar_len, dtype=torch.int32)).unsqueeze(0)
        return (padded, *mask, positions, *k_caches, *v_caches)

    def example_inputs(self) -> Tuple[torch.Tensor, ...]:
        return self.inputs(torch.zeros(self.ar_len, dtype=torch.int32))


@torch.no_grad()
def window_logits(module, static: StaticLlama, tokens: Sequence[int], device: torch.device | None = None
                  ) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one window through `module` (eager static llama or its QDQ program), on the
    CPU; computed on `device` (where qexp.core.device.placed put the module) when given."""
    inputs = static.inputs(tokens)
    if device is not None and device.type != "cpu":
        inputs = tuple(t.to(device) for t in inputs)
    out = module(*inputs)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.reshape(static.ar_len, -1)[: len(tokens)].float().cpu()
