"""What a QDQ program quantizes: one row per quantized tensor (bits, granularity, scales, covered range), the
weight storage it implies, and a short text summary (logged as quant/encodings.csv and quant/summary.txt)."""

from __future__ import annotations

import math

import pandas as pd
import torch

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
    Scales and zero points are left out: under 1% per channel, but not per block (LPBQ adds 4 bits per block: 3% of
    4-bit weights at block 32, 6% at 16; the .pte's size, pte_bytes, counts them). Kept so, not changed, so that
    runs already in a store stay comparable with new ones."""
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
