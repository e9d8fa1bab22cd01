"""Dequantize the QDQ program's weights once, not on every forward; fake-quantize activations in one op.

`convert_pt2e` leaves each weight as an integer constant followed by a `dequantize_per_channel` (or per-tensor /
per-block) op, so every forward of the program dequantizes every weight again: for Gemma-3-270m's tied output alone
that is 168M elements per window. Those ops have constant inputs, so their result is a constant: computing it once
with the very same op and feeding the float tensor to its consumers gives bit-identical outputs (the activations'
quantize/dequantize pairs, which depend on the input, stay). The evaluation runs a folded copy
(`with_weights_dequantized`); the program itself keeps its integer weights (the encodings table and the tests read
them).

Each activation's quantize -> dequantize pair (`quantized_decomposed` ops, written in Python: eight elementwise
passes over the tensor, six fresh tensors and two dispatches into Python) becomes one call of `fake_quantize`: the
same float32 operations in place on one tensor, round(x * (1.0 / s)), clamped to [lo - zp, hi - zp], times s. Adding
zp before the clamp and subtracting it after are exact on these integer values, so they cancel; the result is the
pair's bit for bit. (ATen's fused fake_quantize_per_tensor_affine would be one kernel, but measured 1.4x slower than
the pair on SmolLM2: it also writes a mask.)

Most of those pairs then do nothing: the quantizer annotates a reshape, permute, slice or select with its input's
quantization parameters, so the exported graph quantizes a tensor, views it, and quantizes the view again on the
same grid; and a tensor read by several consumers gets one pair per consumer. A fake quantize is idempotent on its
own grid (a value k * s, k an integer in range, divided by s is within 0.02 of k for |k| <= 65535 in float32, so it
rounds back to k, and k * s is the same product again), so such a repeat returns its input bit for bit and is dropped,
and identical ones share one result (`drop_redundant_fake_quant`).
"""

from __future__ import annotations

import torch

from qexp.quant.fx_constants import constant_value

_FOLDABLE = ("dequantize_per_channel", "dequantize_per_tensor", "dequantize_affine")


def with_weights_dequantized(module: torch.fx.GraphModule, htp_exact_w4_lowering: str | None = None,
                             fuse_activations: bool = True, htp_exact_models: tuple | None = None,
                             drop_redundant: bool = True):
    """A copy of `module` (its own graph; the tensors shared, not copied) with its weights' dequantize ops folded.
    With `htp_exact_w4_lowering` set, its 16-bit-activation layers first get HTP's integer arithmetic
    (qexp.quant.htp_arithmetic_pass, eval.htp_exact) for that 4-bit lowering (`htp_exact_models`: a subset of its
    models, for diagnostics; all by default). The graph is copied node by node with shallow metadata:
    `copy.deepcopy` of a SmolLM2 program's graph (3,400 nodes whose metadata hold fake tensors) took minutes."""
    import copy

    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(module.graph._codegen)  # the exported program's pytree input/output specs
    output = graph.graph_copy(module.graph, {})
    graph.output(output)
    folded = torch.fx.GraphModule(module, graph)
    if htp_exact_w4_lowering is not None:
        from qexp.quant.htp_arithmetic_pass import MODELS, model_htp_arithmetic

        models = MODELS if htp_exact_models is None else htp_exact_models
        folded.htp_counts = model_htp_arithmetic(folded, htp_exact_w4_lowering, models)
    fold_weight_dequantize(folded)
    if fuse_activations:  # off only to measure what it saves (benchmarks/bench_qdq_eval.py)
        fuse_activation_fake_quant(folded)
        if drop_redundant:  # likewise
            drop_redundant_fake_quant(folded)
    return folded


@torch.no_grad()
def fold_weight_dequantize(module: torch.fx.GraphModule) -> int:
    """Replace, in place, every dequantize op whose inputs are all constants by its result (a buffer). Returns how
    many were folded. Integer weights no other node reads are dropped from the module."""
    graph = module.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not any(name in str(node.target) for name in _FOLDABLE):
            continue
        try:
            args = constant_value(module, node.args)
            kwargs = {k: constant_value(module, v) for k, v in node.kwargs.items()}
        except ValueError:
            continue  # an activation's dequantize: depends on the input
        value = node.target(*args, **kwargs)
        name = f"_qexp_folded_weight_{folded}"
        module.register_buffer(name, value)
        with graph.inserting_before(node):
            constant = graph.get_attr(name)
        node.replace_all_uses_with(constant)
        sources = [a for a in node.all_input_nodes if a.op == "get_attr"]
        graph.erase_node(node)
        for source in sources:
            if not source.users:
                target = source.target
                graph.erase_node(source)
                owner, _, attr = target.rpartition(".")
                parent = module.get_submodule(owner) if owner else module
                if hasattr(parent, attr):
                    delattr(parent, attr)
        folded += 1
    graph.lint()
    module.recompile()
    return folded


_QUANTIZE = "quantized_decomposed.quantize_per_tensor.default"
_DEQUANTIZE = "quantized_decomposed.dequantize_per_tensor.default"


def fake_quantize(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
    """dequantize_per_tensor(quantize_per_tensor(x, ...)) of a float32 tensor, bit for bit, in one buffer."""
    out = x * (1.0 / scale)  # as quantize_per_tensor: the reciprocal in double, the product in float32
    out.round_()
    out.clamp_(quant_min - zero_point, quant_max - zero_point)
    return out.mul_(scale)


def _is_float32(node) -> bool:
    """Whether a graph value is a float32 tensor: from the export's metadata, or because it is a fake quantize or a
    dequantize (to float32) output (requantized activations: a pair fed by another pair)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target is fake_quantize:
        return True
    if str(node.target) == _DEQUANTIZE and node.kwargs.get("out_dtype") in (None, torch.float32):
        return True
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32


def fuse_activation_fake_quant(module: torch.fx.GraphModule) -> int:
    """Replace, in place, each dequantize_per_tensor(quantize_per_tensor(x, s, zp, lo, hi, dtype), the same qparams)
    of a float32 activation by fake_quantize(x, s, zp, lo, hi): bit-identical (module docstring).
    Returns how many dequantize ops were replaced; a quantize op whose outputs all went is dropped."""
    graph = module.graph
    fused = 0
    for dq in list(graph.nodes):
        if dq.op != "call_function" or str(dq.target) != _DEQUANTIZE or dq.kwargs.get("out_dtype") not in (
                None, torch.float32):
            continue
        q = dq.args[0]
        if not isinstance(q, torch.fx.Node) or q.op != "call_function" or str(q.target) != _QUANTIZE:
            continue
        x, scale, zero_point, quant_min, quant_max, dtype = q.args
        if tuple(dq.args[1:]) != (scale, zero_point, quant_min, quant_max, dtype) or not all(
                isinstance(v, (int, float)) for v in (scale, zero_point, quant_min, quant_max)):
            continue
        if not _is_float32(x):
            continue
        with graph.inserting_before(dq):
            fake = graph.call_function(fake_quantize,
                                       (x, float(scale), int(zero_point), int(quant_min), int(quant_max)))
        fake.meta = dict(dq.meta)
        dq.replace_all_uses_with(fake)
        graph.erase_node(dq)
        if not q.users:
            graph.erase_node(q)
        fused += 1
    graph.lint()
    module.recompile()
    return fused


# ops whose every output element is one of their (first) input's elements: a value on a grid stays on it
_VALUE_PRESERVING = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
    "aten.transpose.int", "aten.t.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
    "aten.unsqueeze.default", "aten.expand.default", "aten.slice.Tensor", "aten.select.int", "aten.clone.default",
    "aten.alias.default", "aten.contiguous.default", "aten.index.Tensor", "aten.index_select.default",
})


def _on_grid(node, params: tuple) -> bool:
    """Whether every value of `node` is the output of a fake quantize with `params` (through value-preserving ops;
    a cat when all its inputs are)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is fake_quantize:
            return tuple(node.args[1:]) == params
        target = str(node.target)
        if target == "aten.cat.default":
            return all(_on_grid(part, params) for part in node.args[0])
        if target not in _VALUE_PRESERVING:
            return False
        node = node.args[0]
    return False


def drop_redundant_fake_quant(module: torch.fx.GraphModule) -> int:
    """In place: remove each fake_quantize whose input is already on its grid (module docstring) and let identical
    fake_quantize calls (same input, same parameters) share the first one's result. Bit-identical; returns how many
    calls went."""
    graph = module.graph
    dropped = 0
    first: dict = {}
    for node in list(graph.nodes):
        if node.target is not fake_quantize:
            continue
        source, params = node.args[0], tuple(node.args[1:])
        keep = first.get((source, params))
        if keep is None and params[3] - params[2] <= 65535 and _on_grid(source, params):  # the bound above
            keep = source
        if keep is None:
            first[(source, params)] = node
            continue
        node.replace_all_uses_with(keep)
        graph.erase_node(node)
        dropped += 1
    graph.lint()
    module.recompile()
    return dropped
