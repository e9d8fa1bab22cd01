"""A `quant` + `observer` config -> upstream's QuantRecipe and a QnnQuantizer.

The config maps onto upstream's QuantRecipe builder (the one its static-llama recipes use): a default strategy for
every op (activations at the scheme's bits, per tensor), a conv strategy for the weights (every linear is a 1x1
conv in the static llama), regex overrides by module path, and custom annotations by name.
"""

from __future__ import annotations

import re

import torch

from qexp import upstream
from qexp.core.config import (FLOAT_ACTIVATION_SCHEME, NO_QUANT, QDQ_ONLY_SCHEMES, Granularity, ObserverConfig,
                         ObserverKind, QuantConfig, WeightRange, check_scheme)
from qexp.core.errors import ConfigError
from qexp.upstream.private_quantize import quantizer_keeping_hadamard_matmul

_GRANULARITY = {
    Granularity.per_tensor: upstream.QuantGranularity.PER_TENSOR,
    Granularity.per_channel: upstream.QuantGranularity.PER_CHANNEL,
    Granularity.per_block: upstream.QuantGranularity.PER_BLOCK,
}


def quant_dtype(scheme: str):
    check_scheme(scheme)
    return getattr(upstream.QuantDtype, f"use_{QDQ_ONLY_SCHEMES.get(scheme, scheme)}")


def _is_block(scheme: str) -> bool:
    return scheme.endswith("_block")


def custom_annotation(name: str):
    fn = getattr(upstream.custom_annotation, name, None)
    if not callable(fn) or not (name.startswith("annotate") or name.startswith("custom_annotate")):
        valid = sorted(
            n for n in dir(upstream.custom_annotation)
            if (n.startswith("annotate") or n.startswith("custom_annotate"))
            and callable(getattr(upstream.custom_annotation, n))
        )
        raise ConfigError(f"unknown custom annotation {name!r}", f"choose from: {', '.join(valid)}")
    return fn


def observer_class(cfg: ObserverConfig) -> type:
    """An observer class for activations. torchao's prepare needs a class (it reads __name__), not a partial."""
    from torchao.quantization.pt2e import MinMaxObserver, MovingAverageMinMaxObserver

    if cfg.kind == ObserverKind.minmax:
        return MinMaxObserver
    if cfg.kind == ObserverKind.moving_average:
        if not 0 < cfg.averaging_constant <= 1:
            raise ConfigError(f"observer.averaging_constant={cfg.averaging_constant}", "use a value in (0, 1]")
        constant = float(cfg.averaging_constant)

        class ConfiguredMovingAverageMinMaxObserver(MovingAverageMinMaxObserver):
            def __init__(self, **kwargs):
                kwargs.setdefault("averaging_constant", constant)
                super().__init__(**kwargs)

        return ConfiguredMovingAverageMinMaxObserver
    if cfg.kind == ObserverKind.percentile:
        if not 50 < cfg.percentile <= 100:
            raise ConfigError(f"observer.percentile={cfg.percentile}", "use a value in (50, 100]")
        return _percentile_observer(float(cfg.percentile))
    raise ConfigError(f"unknown observer kind {cfg.kind}")


def _percentile_observer(percentile: float) -> type:
    from torchao.quantization.pt2e import MinMaxObserver

    class PercentileObserver(MinMaxObserver):
        """Range = running min/max over batches of each batch's (100-p)th / p-th percentile."""

        max_samples = 1 << 20  # strided subsample of big tensors (e.g. logits) to bound the sort's cost

        def forward(self, x_orig):
            if x_orig.numel() == 0:
                return x_orig
            x = x_orig.detach().to(self.min_val.dtype).flatten()
            if x.numel() > self.max_samples:
                x = x[:: x.numel() // self.max_samples + 1]
            k_low = max(1, int(round(x.numel() * (100.0 - percentile) / 100.0)))
            k_high = max(1, min(x.numel(), int(round(x.numel() * percentile / 100.0))))
            low, high = x.kthvalue(k_low).values, x.kthvalue(k_high).values
            self.min_val.copy_(torch.minimum(low, self.min_val))
            self.max_val.copy_(torch.maximum(high, self.max_val))
            return x_orig

    return PercentileObserver


def _strategy_kwargs(granularity: Granularity, block_size: int) -> dict:
    kwargs = {"granularity": _GRANULARITY[granularity]}
    if granularity == Granularity.per_block:
        if block_size < 1:
            raise ConfigError(f"block_size={block_size}", "use a positive block size")
        # conv2d weight is (out, in, 1, 1): one scale per `block_size` input channels of each output channel
        kwargs["extra_kwargs"] = {"block_size": (1, int(block_size), 1, 1)}
    return kwargs


def recipe_steps(quant: QuantConfig, observer: ObserverConfig) -> list:
    """The recipe as upstream's builder calls, [(method, args, kwargs), ...]: the QuantRecipe constructor first
    ("QuantRecipe"), then its add_node_target / add_regex calls, then one ("annotation", (name,), {}) per custom
    annotation. `build_recipe` runs them; qexp/quant/export.py writes them out as an ExecuTorch recipe class, so the
    two cannot differ."""
    from qexp.quant.grid import override_weight_regex

    act_observer = observer_class(observer)
    dtype = quant_dtype(quant.scheme)
    if quant.weight_granularity == Granularity.per_block and not _is_block(quant.scheme):
        raise ConfigError(f"quant.weight_granularity=per_block needs a block scheme (16a4w_block, 16a3w_block), "
                          f"not {quant.scheme}")
    steps = [("QuantRecipe", (dtype, False), dict(
        act_observer=act_observer, granularity=upstream.QuantGranularity.PER_TENSOR,
        act_symmetric=quant.act_symmetric, note=f"{quant.scheme} default"))]
    steps.append(("add_node_target", ({torch.ops.aten.conv2d.default}, dtype, False), dict(
        act_observer=act_observer, act_symmetric=quant.act_symmetric, note="weights of conv/linear layers",
        **_strategy_kwargs(quant.weight_granularity, quant.block_size))))
    for override in quant.overrides:
        override_dtype = quant_dtype(override.scheme)
        if override.granularity == Granularity.per_block and not _is_block(override.scheme):
            raise ConfigError(f"override {override.pattern!r}: per_block needs a block scheme (16a4w_block)")
        if override.scheme in QDQ_ONLY_SCHEMES:
            raise ConfigError(f"override {override.pattern!r}: scheme {override.scheme} only as the main scheme",
                              "set quant.scheme to it instead")
        common = dict(act_observer=act_observer, act_symmetric=override.act_symmetric,
                      note=override.note or override.pattern)
        # The weight rule matches conv modules only (override_weight_regex); the activations in the same scope get
        # the override's bits per tensor.
        steps.append(("add_regex", ({override_weight_regex(override.pattern)}, override_dtype, False), dict(
            priority=3, **common, **_strategy_kwargs(override.granularity, override.block_size))))
        steps.append(("add_regex", ({override.pattern}, override_dtype, False), dict(
            priority=2, **common, granularity=upstream.QuantGranularity.PER_TENSOR)))
    for name in quant.custom_annotations:
        custom_annotation(name)  # an unknown name is refused here, with the valid ones
        steps.append(("annotation", (name,), {}))
    return steps


def build_recipe(quant: QuantConfig, observer: ObserverConfig):
    (_, args, kwargs), *calls = recipe_steps(quant, observer)
    recipe = upstream.QuantRecipe(*args, **kwargs)
    for method, args, kwargs in calls:
        if method == "annotation":
            recipe.custom_quant_annotations.append(custom_annotation(*args))
        else:
            getattr(recipe, method)(*args, **kwargs)
    return recipe


def make_quantizer(quant: QuantConfig, observer: ObserverConfig, soc: str, recompose_hadamard: bool = True):
    """QnnQuantizer for `soc` with the recipe. Without `recompose_hadamard` the R3 rotation stays a plain matmul:
    QNN 2.49's HTP cannot build its HadamardTransform op in an AR-N prefill graph and takes it only at 16 bits."""
    quantizer_cls = (upstream.QnnQuantizer if recompose_hadamard
                     else quantizer_keeping_hadamard_matmul(upstream.QnnQuantizer))
    if quant.scheme in QDQ_ONLY_SCHEMES:
        quantizer_cls = _with_4bit_weights_as(quantizer_cls, -3, 3)
    elif WeightRange(quant.get("weight_range", "narrow")) == WeightRange.full:
        quantizer_cls = _with_4bit_weights_as(quantizer_cls, -8, 7)
    if quant.scheme == FLOAT_ACTIVATION_SCHEME:
        quantizer_cls = _with_float_embedding(quantizer_cls)
    quantizer = quantizer_cls(soc_model=getattr(upstream.QcomChipset, soc))
    quantizer.set_recipe(build_recipe(quant, observer))
    return quantizer


def _with_4bit_weights_as(quantizer_cls, quant_min: int, quant_max: int):
    """The recipe's 4-bit conv weights ([-7, 7]) annotated with another integer range instead: [-3, 3] for the 3-bit
    research schemes (scale = absmax / 3), [-8, 7] for quant.weight_range=full (absmax / 7.5); 8-bit overrides (the
    lm head) keep theirs. The observers read quant_min / quant_max from the annotation."""
    import dataclasses

    class QnnQuantizerWeightRange(quantizer_cls):
        def annotate(self, model):
            model = super().annotate(model)
            for node in model.graph.nodes:
                annotation = node.meta.get("quantization_annotation")
                if node.target != torch.ops.aten.conv2d.default or annotation is None or len(node.args) < 2:
                    continue
                weight = node.args[1]
                spec = annotation.input_qspec_map.get(weight)
                if spec is not None and getattr(spec, "quant_min", None) == -7 and spec.quant_max == 7:
                    annotation.input_qspec_map[weight] = dataclasses.replace(spec, quant_min=quant_min,
                                                                             quant_max=quant_max)
            return model

    return QnnQuantizerWeightRange


def _with_float_embedding(quantizer_cls):
    """fp16a8w's embedding left unannotated (a float gather): QnnQuantizer quantizes the embedding table with the
    activation spec, which fp16a8w does not have (None), and shares it with the lookup's output, so torchao's
    prepare_pt2e fails on it ('NoneType' object has no attribute 'to'). Upstream tests fp16a8w on single convolutions
    and linears only."""

    class QnnQuantizerFloatEmbedding(quantizer_cls):
        def annotate(self, model):
            model = super().annotate(model)
            for node in model.graph.nodes:
                if node.target == torch.ops.aten.embedding.default:
                    node.meta.pop("quantization_annotation", None)
            return model

    return QnnQuantizerFloatEmbedding


def validate_recipe(quant: QuantConfig, observer: ObserverConfig) -> None:
    """Check a recipe before a run starts (unknown schemes, annotations, bad observer values)."""
    if quant.scheme == NO_QUANT:
        return
    full_range = WeightRange(quant.get("weight_range", "narrow")) == WeightRange.full
    if full_range and (quant.scheme in QDQ_ONLY_SCHEMES or "a4w" not in quant.scheme):
        raise ConfigError(f"quant.weight_range=full with quant={quant.scheme}: the full [-8, 7] range is for 4-bit "
                          "weights", "use a 4-bit scheme (16a4w, 16a4w_block, 8a4w), or weight_range=narrow")
    check_override_patterns(quant)
    build_recipe(quant, observer)


def check_override_patterns(quant: QuantConfig) -> None:
    """Each override's pattern must be a regex: the error names the override and the position in its own pattern
    (the recipe wraps it in a larger regex, whose positions would mislead)."""
    for i, override in enumerate(quant.overrides):
        try:
            re.compile(override.pattern)
        except re.error as exc:
            raise ConfigError(f"quant.overrides[{i}] pattern {override.pattern!r} is not a valid regex ({exc})",
                              "fix the pattern (a Python regex over module paths such as "
                              "layers.3.feed_forward.w2_conv), escaping literal dots and brackets") from None


def uses_blocks(quant: QuantConfig) -> bool:
    """Whether any weight of the recipe is quantized per block (the main scheme or an override)."""
    return quant.scheme != NO_QUANT and (quant.weight_granularity == Granularity.per_block or any(
        o.granularity == Granularity.per_block for o in quant.overrides))


def check_overrides_match(quant: QuantConfig, shapes: dict) -> None:
    """Every override must select at least one weight layer of the model: a pattern that matches nothing (a typo, a
    layer name of another family) would silently leave the recipe at its default scheme. `shapes` as for
    check_block_sizes."""
    from qexp.models.shapes import static_module_path
    from qexp.quant.grid import override_weight_regex, weight_layers

    if quant.scheme == NO_QUANT or not quant.overrides:
        return
    paths = [static_module_path(key) for key in weight_layers(shapes)]
    if not paths:
        return
    for override in quant.overrides:
        try:
            pattern = re.compile(override_weight_regex(override.pattern))
        except re.error as exc:
            raise ConfigError(f"quant.overrides pattern {override.pattern!r} is not a valid regex ({exc})") from None
        if not any(pattern.search(path) for path in paths):
            examples = ", ".join(sorted({re.sub(r"layers\.\d+\.", "layers.N.", p) for p in paths})[:8])
            raise ConfigError(f"quant.overrides pattern {override.pattern!r} matches no weight layer of this model",
                              f"layer paths look like: {examples}")


def check_block_sizes(quant: QuantConfig, shapes: dict) -> None:
    """Every per-block weight's input channels must split into whole blocks: one line naming the layer and the sizes
    that would fit. `shapes`: Meta weight name -> shape, from the model's metadata before any work
    (qexp/models/shapes.py) and again from the loaded weights."""
    from qexp.models.shapes import static_module_path
    from qexp.quant.grid import grid_for, weight_layers

    if quant.scheme == NO_QUANT:
        return
    for key in weight_layers(shapes):
        grid = grid_for(quant, key)
        cols = shapes[key][1]
        if grid is not None and grid.block_size and cols % grid.block_size:
            fits = [b for b in (16, 32, 48, 64, 96, 128, 192, 256) if cols % b == 0]
            raise ConfigError(f"block_size={grid.block_size} does not divide the {cols} input channels of "
                              f"{static_module_path(key)}", f"use a block size that divides it, e.g. {fits}")
