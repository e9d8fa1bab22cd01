"""Quantize + calibrate stage: recipe + observer -> QnnQuantizer -> prepare_pt2e -> calibrate -> convert_pt2e.

A `quant` config maps onto upstream's QuantRecipe builder (the one its static-llama recipes use): a default
strategy for every op (activations at the scheme's bits, per tensor), a conv strategy for the weights (every
linear is a 1x1 conv in the static llama), regex overrides by module path, and custom annotations by name.
The converted (QDQ) program is cached, keyed by everything that determines it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from qexp import upstream
from qexp.cache import Cache
from qexp.calibration import CalibrationSet
from qexp.config import NO_QUANT, SCHEMES, Granularity, ObserverConfig, ObserverKind, QuantConfig
from qexp.errors import ConfigError
from qexp.static_model import StaticLlama
from qexp.timing import StageTimer

log = logging.getLogger("qexp")

QDQ_PROGRAM = "qdq.pt2"
OBSERVERS = "observers.pt"  # calibrated observer statistics, to quantize other graphs of the same model
# Non-strict export: 4x faster than strict (dynamo) tracing here, same graph. Graphs that later take these
# encodings (kv / prefill) must be exported the same way.
EXPORT_STRICT = False
_GRANULARITY = {
    Granularity.per_tensor: upstream.QuantGranularity.PER_TENSOR,
    Granularity.per_channel: upstream.QuantGranularity.PER_CHANNEL,
    Granularity.per_block: upstream.QuantGranularity.PER_BLOCK,
}


# ---------------------------------------------------------------- config -> upstream objects
def quant_dtype(scheme: str):
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown quantization scheme {scheme!r}", f"choose one of: {', '.join(SCHEMES)}")
    return getattr(upstream.QuantDtype, f"use_{scheme}")


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


def build_recipe(quant: QuantConfig, observer: ObserverConfig):
    act_observer = observer_class(observer)
    dtype = quant_dtype(quant.scheme)
    if quant.weight_granularity == Granularity.per_block and quant.scheme != "16a4w_block":
        raise ConfigError(f"quant.weight_granularity=per_block needs scheme 16a4w_block, not {quant.scheme}")
    recipe = upstream.QuantRecipe(
        dtype, False, act_observer=act_observer, granularity=upstream.QuantGranularity.PER_TENSOR,
        act_symmetric=quant.act_symmetric, note=f"{quant.scheme} default",
    )
    recipe.add_node_target(
        {torch.ops.aten.conv2d.default}, dtype, False, act_observer=act_observer,
        act_symmetric=quant.act_symmetric, note="weights of conv/linear layers",
        **_strategy_kwargs(quant.weight_granularity, quant.block_size),
    )
    for override in quant.overrides:
        override_dtype = quant_dtype(override.scheme)
        if override.granularity == Granularity.per_block and override.scheme != "16a4w_block":
            raise ConfigError(f"override {override.pattern!r}: per_block needs scheme 16a4w_block")
        common = dict(act_observer=act_observer, act_symmetric=override.act_symmetric,
                      note=override.note or override.pattern)
        # A module-path regex also matches the non-weight ops inside that module (silu, mul, ...), which have no
        # channel axis: the weight rule is limited to conv modules (lookahead: the path ends in "conv"), and the
        # activations in the same scope get the override's bits per tensor.
        recipe.add_regex({f"(?=.*conv$)(?:{override.pattern})"}, override_dtype, False, priority=3, **common,
                         **_strategy_kwargs(override.granularity, override.block_size))
        recipe.add_regex({override.pattern}, override_dtype, False, priority=2, **common,
                         granularity=upstream.QuantGranularity.PER_TENSOR)
    recipe.custom_quant_annotations.extend(custom_annotation(name) for name in quant.custom_annotations)
    return recipe


def _quantizer_keeping_hadamard_matmul():
    """A QnnQuantizer that leaves the R3 Hadamard rotation a plain matmul.

    Upstream's HTP annotation passes include RecomposeHadamard, which (QNN >= 2.47) turns the rotation into QNN's
    HadamardTransform op. With the QNN 2.49 x86 libraries, HTP graph preparation cannot build the q-side one in an
    AR-N prefill graph (`could not create op: q::ConvLayer_s1.opt`, FIELD-NOTES), and it accepts only 16-bit
    activations. Without the pass the rotation stays a matmul with the same weights: same math, buildable.
    """
    from executorch.backends.qualcomm._passes import RecomposeHadamard
    from executorch.backends.qualcomm._passes.backends.htp.qnn_htp_pass_manager import QnnHtpPassManager

    class PassesWithoutHadamardRecompose(QnnHtpPassManager):
        @classmethod
        def get_annotation_passes(cls):
            return [p for p in super().get_annotation_passes() if p is not RecomposeHadamard]

    class QnnQuantizerKeepingHadamardMatmul(upstream.QnnQuantizer):
        def transform_for_annotation(self, model):
            return PassesWithoutHadamardRecompose().transform_for_annotation_pipeline(model)

    return QnnQuantizerKeepingHadamardMatmul


def make_quantizer(quant: QuantConfig, observer: ObserverConfig, soc: str = "SM8650", recompose_hadamard: bool = True):
    quantizer_cls = upstream.QnnQuantizer if recompose_hadamard else _quantizer_keeping_hadamard_matmul()
    quantizer = quantizer_cls(soc_model=getattr(upstream.QcomChipset, soc))
    quantizer.set_recipe(build_recipe(quant, observer))
    return quantizer


def validate_recipe(quant: QuantConfig, observer: ObserverConfig) -> None:
    """Check a recipe before a run starts (unknown schemes, annotations, bad observer values)."""
    if quant.scheme == NO_QUANT:
        return
    build_recipe(quant, observer)


# ---------------------------------------------------------------- the stage
@dataclass
class QuantizedModel:
    module: torch.fx.GraphModule  # the QDQ program (fake-quantized ops, runs on CPU)
    program_path: Path  # the cached ExportedProgram (.pt2)
    key: str
    cache_hit: bool


def quantize(
    static: StaticLlama, quant: QuantConfig, observer: ObserverConfig, calibration: CalibrationSet,
    cache: Cache, key: str, soc: str = "SM8650", timer: StageTimer | None = None, recompose_hadamard: bool = True,
) -> QuantizedModel:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    timer = timer or StageTimer()

    def build(tmp: Path) -> dict:
        quantizer = make_quantizer(quant, observer, soc, recompose_hadamard)
        example = static.example_inputs()
        with torch.no_grad():
            with timer.stage("export"):
                graph = torch.export.export(static.module, example, strict=EXPORT_STRICT).module()
            with timer.stage("prepare"):
                prepared = prepare_pt2e(graph, quantizer)
            with timer.stage("calibrate"):
                for sample in tqdm(calibration.samples, desc="calibrate", unit="sample", leave=False):
                    prepared(*static.inputs(sample))
            torch.save(observer_statistics(prepared), tmp / OBSERVERS)
            with timer.stage("convert"):
                converted = convert_pt2e(prepared)
            with timer.stage("save_qdq"):
                torch.export.save(torch.export.export(converted, example, strict=False), str(tmp / QDQ_PROGRAM))
        return {"samples": len(calibration.samples), "tokens": calibration.n_tokens}

    path, hit = cache.get_or_build("qdq", key, build)
    log.info("QDQ program %s (%s)", path, "cache hit" if hit else "built")
    # Always evaluate the program as loaded from the cache, also right after building it: on SmolLM2 16a4w the
    # in-memory program (converted or re-exported) gives ppl 47.29 and its reload 47.25 (measured twice), and a
    # config must give the same numbers cold and warm.
    import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401 - registers the ops a saved QDQ program uses

    with timer.stage("load_qdq"):
        module = torch.export.load(str(path / QDQ_PROGRAM)).module()
    return QuantizedModel(module, path / QDQ_PROGRAM, key, hit)


def observer_statistics(prepared: torch.fx.GraphModule) -> dict:
    """Calibrated state of every observer of a prepared graph, with what it observes.

    Graphs of the same model with another AR length (the kv and prefill graphs of the deploy phase) have the same
    observers; loading these statistics into them before convert_pt2e reproduces this calibration without
    re-running it. Plain tensors and strings only, so it loads with weights_only=True.
    """
    stats = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not node.target.startswith("activation_post_process"):
            continue
        observer = getattr(prepared, node.target)
        source = node.args[0] if node.args else None
        stack = getattr(source, "meta", {}).get("nn_module_stack") if source is not None else None
        stats[node.target] = {
            "observes": getattr(source, "name", ""),
            "module": list(stack.values())[-1][0] if stack else "",
            "state": {k: v.clone() for k, v in observer.state_dict().items()},
        }
    return stats


# ---------------------------------------------------------------- summary
# Every quantized tensor of a converted program ends in a dequantize op: weights as dequantize(<int constant>)
# (convert_pt2e folds their quantize op away), activations as dequantize(quantize(x)).
_DEQUANT_OPS = {
    "quantized_decomposed.dequantize_per_tensor.default": "per_tensor",
    "quantized_decomposed.dequantize_per_channel.default": "per_channel",
    "torchao.dequantize_affine": "per_block",  # an OpOverloadPacket in converted programs
    "torchao.dequantize_affine.default": "per_block",
}


def encodings_table(module: torch.fx.GraphModule) -> pd.DataFrame:
    """One row per quantized tensor of the QDQ program: what it is, bits, granularity, scales, covered range."""
    rows, seen = [], set()
    for node in module.graph.nodes:
        kind = _DEQUANT_OPS.get(str(node.target))
        if node.op != "call_function" or kind is None:
            continue
        producer = node.args[0]
        is_weight = producer.op == "get_attr"
        if producer in seen:  # one dequantize per consumer of the same quantized activation
            continue
        seen.add(producer)
        if kind == "per_tensor":
            scales = torch.tensor([float(_value(module, node.args[1]))])
            zero_points = torch.tensor([float(_value(module, node.args[2]))])
            qmin, qmax = node.args[3], node.args[4]
        elif kind == "per_channel":
            scales = _value(module, node.args[1]).float().flatten()
            zero_points = _value(module, node.args[2]).float().flatten()
            qmin, qmax = node.args[4], node.args[5]
        else:
            scales = _value(module, node.args[2]).float().flatten()
            zero_points = _value(module, node.args[3]).float().flatten()
            qmin, qmax = node.args[5], node.args[6]
        # name the tensor by what computes it (activation) or what consumes it (weight)
        owner = next(iter(node.users), node) if is_weight else producer.args[0] if producer.args else producer
        stack = getattr(owner, "meta", {}).get("nn_module_stack")
        rows.append({
            "tensor": producer.target if is_weight else getattr(owner, "name", str(owner)),
            "module": list(stack.values())[-1][0].replace(".forward.__self__", "") if stack else "",
            "weight": is_weight,
            "granularity": kind,
            "bits": _bits(qmin, qmax),
            "numel": _value(module, producer).numel() if is_weight else 0,
            "n_scales": scales.numel(),
            "scale_min": scales.min().item(),
            "scale_max": scales.max().item(),
            "range_min": ((qmin - zero_points) * scales).min().item(),
            "range_max": ((qmax - zero_points) * scales).max().item(),
        })
    return pd.DataFrame(rows)


def weights_megabytes(float_module: torch.nn.Module, table: pd.DataFrame | None = None) -> float:
    """Weight storage in MB: quantized weights at their bit width (per the encodings table), the rest at fp32.
    Scales and zero points are left out (under 1% at these granularities)."""
    total = sum(p.numel() for p in float_module.parameters())
    if table is None or table.empty:
        return total * 4 / 1e6
    weights = table[table["weight"]]
    quantized = int(weights["numel"].sum())
    return (float((weights["numel"] * weights["bits"]).sum()) / 8 + (total - quantized) * 4) / 1e6


def _value(module: torch.nn.Module, arg):
    """A literal argument, or the constant tensor a get_attr node points at."""
    if not isinstance(arg, torch.fx.Node):
        return arg if not isinstance(arg, torch.Tensor) else arg
    obj = module
    for part in str(arg.target).split("."):
        obj = getattr(obj, part)
    return obj


def _bits(qmin, qmax) -> int:
    import math

    span = int(qmax) - int(qmin) + 1
    return int(round(math.log2(span))) if span > 1 else 0


def summarize_encodings(table: pd.DataFrame) -> str:
    if table.empty:
        return "no quantize ops"
    lines = ["quantize ops by kind and bit width:"]
    grouped = table.groupby(["weight", "granularity", "bits"]).size()
    for (is_weight, granularity, bits), count in grouped.items():
        lines.append(f"  {'weight' if is_weight else 'activation':10s} {granularity:11s} {bits:2d}-bit: {count}")
    widest = table[~table["weight"]].sort_values("range_max", ascending=False).head(5)
    lines.append("widest activation ranges (most sensitive to clipping / resolution):")
    for _, row in widest.iterrows():
        lines.append(f"  {row['tensor']:40s} [{row['range_min']:.3g}, {row['range_max']:.3g}] {row['bits']}-bit")
    return "\n".join(lines)
