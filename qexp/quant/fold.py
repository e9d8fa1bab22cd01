"""Dequantize the QDQ program's weights once, not on every forward.

`convert_pt2e` leaves each weight as an integer constant followed by a `dequantize_per_channel` (or per-tensor /
per-block) op, so every forward of the program dequantizes every weight again: for Gemma-3-270m's tied output alone
that is 168M elements per window. Those ops have constant inputs, so their result is a constant: computing it once
with the very same op and feeding the float tensor to its consumers gives bit-identical outputs (the activations'
quantize/dequantize pairs, which depend on the input, stay). The evaluation runs a folded copy
(`with_weights_dequantized`); the program itself keeps its integer weights (the encodings table and the tests read
them).
"""

from __future__ import annotations

import torch

_FOLDABLE = ("dequantize_per_channel", "dequantize_per_tensor", "dequantize_affine")


def constant_value(module: torch.fx.GraphModule, arg):
    if isinstance(arg, torch.fx.Node):
        if arg.op != "get_attr":
            raise ValueError("not a constant")
        value = module
        for part in arg.target.split("."):
            value = getattr(value, part)
        return value
    if isinstance(arg, (list, tuple)):
        return type(arg)(constant_value(module, a) for a in arg)
    return arg


def with_weights_dequantized(module: torch.fx.GraphModule, htp_exact_w4_lowering: str | None = None):
    """A copy of `module` (its own graph; the tensors shared, not copied) with its weights' dequantize ops folded.
    With `htp_exact_w4_lowering` set, its 16-bit-activation layers first get HTP's integer arithmetic
    (qexp.quant.htp_arithmetic, eval.htp_exact) for that 4-bit lowering. The graph is copied node by node with shallow metadata: `copy.deepcopy` of a SmolLM2 program's graph (3,400
    nodes whose metadata hold fake tensors) took minutes."""
    import copy

    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(module.graph._codegen)  # the exported program's pytree input/output specs
    output = graph.graph_copy(module.graph, {})
    graph.output(output)
    folded = torch.fx.GraphModule(module, graph)
    if htp_exact_w4_lowering is not None:
        from qexp.quant.htp_arithmetic import model_htp_arithmetic

        folded.htp_counts = model_htp_arithmetic(folded, htp_exact_w4_lowering)
    fold_weight_dequantize(folded)
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
