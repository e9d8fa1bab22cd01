"""One deploy graph of the static llama (an AR length's kv_forward or prefill_forward), quantized with the
calibration's encodings: exported and prepared like the calibration graph, given its observer statistics before
convert_pt2e (the cache inputs take their outputs' encodings), its unread float weights dropped; and what the runner
needs of its I/O encodings. qexp/backends/htp/lower.py lowers these graphs into one .pte."""

from __future__ import annotations

import torch

from qexp.core.errors import ConfigError
from qexp.models.loaded import LoadedModel
from qexp.models.static_llama import StaticLlama
from qexp.quant.calibrate import EXPORT_STRICT, load_observer_statistics, observer_statistics
from qexp.quant.recipe import make_quantizer
from qexp.upstream.private import tree_leaves
from qexp.upstream.private_quantize import convert_in_chunks, forget_prepared_modules


def io_bits(qrange) -> int:
    """Bit width of a graph edge from its encoding's [qmin, qmax]: 8 or 16 (what the runner feeds and reads)."""
    return 8 if qrange[1] <= 255 else 16


def quantized_graph(
    model: LoadedModel, context: int, ar_len: int, r3: bool, quant, observer, stats: dict, recompose_hadamard: bool,
    soc: str, masked_softmax: bool = False,
):
    """The static llama for `ar_len`, quantized with the calibration graph's observer statistics."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    static = StaticLlama(model, context, r3=r3, ar_len=ar_len, masked_softmax=masked_softmax)
    example = static.example_inputs()
    with torch.no_grad():
        graph = torch.export.export(static.module, example, strict=EXPORT_STRICT).module()
        prepared = prepare_pt2e(graph, make_quantizer(quant, observer, soc, recompose_hadamard))
    forget_prepared_modules()
    own = observer_statistics(prepared)
    if [(k, v["observes"]) for k, v in own.items()] != [(k, v["observes"]) for k, v in stats.items()]:
        # Seen with R3 + RecomposeHadamard: the rotation is recomposed into HadamardTransform in some AR lengths only.
        hint = "set model.recompose_hadamard=false" if r3 and recompose_hadamard else "report this model/config"
        raise ConfigError(
            f"the AR-{ar_len} graph does not have the calibration graph's observers ({len(own)} vs {len(stats)}), "
            "so its encodings cannot be transferred",
            hint,
        )
    load_observer_statistics(prepared, stats)
    _tie_cache_inputs_to_outputs(prepared, static.n_layers)
    with torch.no_grad():
        converted = convert_in_chunks(prepared)  # convert_pt2e's program without its float copies (as the QDQ one)
    forget_prepared_modules()
    drop_unused_attributes(converted)
    return converted, static


def drop_unused_attributes(module: torch.fx.GraphModule) -> int:
    """Delete the parameters and buffers no node of `module`'s graph reads; returns the bytes let go.

    convert_pt2e folds each weight's quantize into a new constant (`_frozen_paramN`, the integer weight) and leaves
    the float weight it came from on the module, unread: on SmolLM2 621 MiB of fp32 per deploy graph (303 tensors),
    beside 239 MiB the graph uses. Upstream's lowering exports the module again, which lifts every parameter into
    the lowered program's state_dict (where parallel.drop_unused_weights found them), and a forked compile worker
    inherits them from its parent. Nothing reads them: without them the program has the same size and gives
    bit-identical emulator outputs (tests/test_htp.py; two lowerings of one graph never give identical bytes, QNN's
    context binary differs each time). The parallel lowering's parent forks at 2.16 instead of 2.95 GiB.
    (ExecuTorch's remove_unused_parameters_pass does this for an ExportedProgram's placeholders; this module is not
    exported yet, and exporting it first is the copy this avoids.)
    """
    read = {node.target for node in module.graph.nodes if node.op == "get_attr"}

    def is_read(name: str) -> bool:
        return name in read or any(name.startswith(target + ".") for target in read)

    freed = 0
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if is_read(name):
            continue
        owner, _, leaf = name.rpartition(".")
        delattr(module.get_submodule(owner) if owner else module, leaf)
        freed += tensor.numel() * tensor.element_size()
    return freed


def _tie_cache_inputs_to_outputs(prepared: torch.fx.GraphModule, n_layers: int) -> None:
    placeholders = [n for n in prepared.graph.nodes if n.op == "placeholder"]
    cache_inputs = placeholders[-2 * n_layers :]  # k caches then v caches, as the forward signature
    output = next(n for n in prepared.graph.nodes if n.op == "output")
    outputs = tree_leaves(output.args[0])  # logits, k outputs, v outputs
    for index, placeholder in enumerate(cache_inputs):
        observer_node = next(
            u for u in placeholder.users if u.op == "call_module" and u.target.startswith("activation_post_process")
        )  # not torch's _guards_fn, also a call_module user of the inputs
        produced = outputs[1 + index]
        getattr(prepared, observer_node.target).load_state_dict(getattr(prepared, produced.target).state_dict())


def io_encodings(converted: torch.fx.GraphModule, n_layers: int, n_masks: int = 1) -> dict:
    """Scale/zero point of the logits output and of every cache input (what the runner quantizes/dequantizes)."""
    placeholders = [n for n in converted.graph.nodes if n.op == "placeholder"]

    def input_qparams(node):
        q = _input_quantize(node)
        return [float(q.args[1]), int(q.args[2])]

    output = next(n for n in converted.graph.nodes if n.op == "output")
    logits = tree_leaves(output.args[0])[0]
    mask = _input_quantize(placeholders[1])
    window = {"window_mask": input_qparams(placeholders[2])} if n_masks == 2 else {}  # Gemma 3's sliding layers
    return {**window,
        "logits": [float(logits.args[1]), int(logits.args[2])],
        "logits_range": [int(logits.args[3]), int(logits.args[4])],
        "mask": input_qparams(placeholders[1]),
        "mask_range": [int(mask.args[3]), int(mask.args[4])],
        "kv_range": [int(_input_quantize(placeholders[-n_layers]).args[3]),
                     int(_input_quantize(placeholders[-n_layers]).args[4])],
        "k": [input_qparams(n) for n in placeholders[-2 * n_layers : -n_layers]],
        "v": [input_qparams(n) for n in placeholders[-n_layers:]],
    }


def check_one_kv_cache_width(converted: torch.fx.GraphModule, n_layers: int) -> None:
    """Every cache input and output of a deploy graph at one bit width, or a clear error before lowering: the I/O
    tagging gives all caches one type, and the runner writes each output back into its input unchanged
    (qexp/backends/htp/__init__.py: _check_one_kv_cache_width predicts the usual cause at validation; this is the
    graph's own word). The inputs take their outputs' ranges but keep their own qspec's bit width."""
    placeholders = [n for n in converted.graph.nodes if n.op == "placeholder"]
    caches = placeholders[-2 * n_layers:]
    output = next(n for n in converted.graph.nodes if n.op == "output")
    written = tree_leaves(output.args[0])[1:1 + 2 * n_layers]  # logits, k outputs, v outputs
    width = lambda q: io_bits([int(q.args[3]), int(q.args[4])])  # noqa: E731
    bits = {"k": {width(_input_quantize(n)) for n in caches[:n_layers]} | {width(n) for n in written[:n_layers]},
            "v": {width(_input_quantize(n)) for n in caches[n_layers:]} | {width(n) for n in written[n_layers:]}}
    if len(bits["k"] | bits["v"]) > 1:
        text = {kind: "/".join(map(str, sorted(b))) for kind, b in bits.items()}
        raise ConfigError(
            f"backend=htp: this program's KV caches mix bit widths (k {text['k']}-bit, v {text['v']}-bit, inputs and "
            f"outputs: an override gives the projections writing them other activation bits than the scheme's), and "
            f"HTP programs take one KV cache type",
            "give those projections the scheme's activation bits, or every cache 8 bits "
            "(quant.custom_annotations=[annotate_kv_8bit])")


def _input_quantize(node: torch.fx.Node) -> torch.fx.Node:
    return next(u for u in node.users if "quantize_per_tensor" in str(u.target))
