"""The private ExecuTorch / torch APIs qexp reaches into to lower and export programs, in one place.

Each function here wraps a name with a leading underscore (or a private module such as `_passes`) that upstream may
change without notice; the comment says why qexp needs it. When a version bump breaks one, the qexp/upstream/private*.py
modules are the only files to fix: private.py (lowering and exporting programs), private_quantize.py (quantizing:
torchao's prepare, SpinQuant, SeqMSE, QNN's quantizer) and private_runtime.py (running and inspecting .pte programs).
Public upstream names are re-exported by qexp/upstream/__init__.py.
"""

from __future__ import annotations

import contextlib
from functools import partial
from types import SimpleNamespace

import torch


# ---------------------------------------------------------------- torch
def tree_leaves(tree):
    """torch's pytree flattening (no public module in torch 2.13): the flat outputs of an exported graph."""
    return torch.utils._pytree.tree_leaves(tree)


def _node_source_init_sharing_history(self, node, pass_name: str = "", action=None) -> None:
    """torch.fx.traceback.NodeSource.__init__ without its deep copy of the node's provenance list.

    Every pass that rewrites a node under `set_current_meta` records a NodeSource whose `from_node` was a
    `copy.deepcopy` of the whole chain of earlier NodeSources. The chain grows with every pass, so each record copied
    more: 59 s of SmolLM2's 419 s HTP lowering (export, run_decompositions and ExecuTorch's edge passes) went to those
    copies. NodeSources are records that nothing mutates after construction (torch's own code only builds new ones
    or new lists), so sharing the earlier records gives the same provenance; this keeps a fresh outer list."""
    from torch.fx.traceback import NodeSource, NodeSourceAction

    self.pass_name = pass_name
    action = [] if action is None else (action if isinstance(action, list) else [action])
    for a in action:
        if not isinstance(a, NodeSourceAction):
            raise AssertionError(f"Expected NodeSourceAction, got {type(a)}")
    self.action = action
    if node:
        self.node_info = NodeSource.NodeInfo(name=node.name, target=str(node.target), graph_id=id(node.graph))
        self.from_node = list(node.meta["from_node"]) if "from_node" in node.meta else []
    else:
        self.node_info = None
        self.from_node = []
    self._action_string = None
    self._dict = None


@contextlib.contextmanager
def provenance_without_deep_copies():
    """While active, torch's node provenance records share their history instead of deep-copying it (see above).
    The lowered program is byte-identical (tests/test_htp.py compares a .pte lowered with and without it)."""
    from torch.fx.traceback import NodeSource

    original = NodeSource.__init__
    NodeSource.__init__ = _node_source_init_sharing_history
    try:
        yield
    finally:
        NodeSource.__init__ = original


def _placeholders_only(check):
    def placeholder_check(program, node) -> bool:
        return node.op == "placeholder" and check(program, node)
    return placeholder_check


@contextlib.contextmanager
def signature_lookups_for_placeholders_only():
    """While active, QNN's `is_parameter` (and the get_parameter around it) asks the program's graph signature whether a
    node is a parameter, buffer or lifted constant only for placeholder nodes.

    Why: its node visitors and passes (AnnotateQuantAttrs, FoldQDQ, define_tensor for every op's every input) ask it
    of every node, and torch's `ExportGraphSignature.inputs_to_buffers` (and `_parameters`) rebuild a dict of all the
    program's inputs on each call: py-spy on SmolLM2's kv-graph lowering put ~45% of it in those rebuilds. Only a
    placeholder can be a lifted input (an FX node's name is unique and the signature names the graph's placeholders),
    so the answers, and the program, are unchanged (tests/test_htp.py compares the programs lowered with and without
    it). Private reach: the names `is_param`, `is_buffer`, `is_lifted_tensor_constant` in
    `executorch.backends.qualcomm.builders.utils`, patched for the block's duration.
    """
    from executorch.backends.qualcomm.builders import utils

    names = ("is_param", "is_buffer", "is_lifted_tensor_constant")
    originals = {name: getattr(utils, name) for name in names}
    for name, check in originals.items():
        setattr(utils, name, _placeholders_only(check))
    try:
        yield
    finally:
        for name, check in originals.items():
            setattr(utils, name, check)


# ---------------------------------------------------------------- ExecuTorch Qualcomm: passes
def quant_io_passes(meta: dict, arch: str, ar_len: int, context: int, kv_type: torch.dtype, io_type: torch.dtype):
    """The capture-program passes and their dependency table for one static-llama graph, with upstream's I/O tagging
    rule (`TextDecoder._tag_ios`: which inputs/outputs stay quantized, the KV caches at `kv_type`, logits and mask
    at `io_type`) activated.
    `_tag_ios` is a method of upstream's decoder wrapper; it reads only these attributes, fed here directly."""
    from executorch.backends.qualcomm._passes import TagQuantIO
    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.utils.constants import (
        QCOM_PASS_ACTIVATE_KEY,
        QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY,
    )
    from executorch.examples.qualcomm.oss_scripts.llama.wrappers.llm_wrappers import TextDecoder

    head_dim = meta["get_head_dim"]
    shapes = SimpleNamespace(
        meta=meta,
        io_shape={(1, ar_len, meta["get_vocab_size"])},
        kv_cache_shape={(head_dim, context), (context, head_dim), (head_dim, ar_len), (ar_len, head_dim)},
        control_args=SimpleNamespace(decoder_model=arch),
    )
    manager = get_qnn_pass_manager_cls()
    job = manager.get_capture_program_passes()
    job[TagQuantIO][QCOM_PASS_ACTIVATE_KEY] = True
    job[TagQuantIO][QCOM_PASS_ARGS_KWARGS_DEFAULTS_KEY]["get_quant_io_dtype_fn"] = partial(
        TextDecoder._tag_ios, shapes, fixed_point_type={"kv_type": kv_type, "io_type": io_type}
    )
    return job, manager.get_passes_dependency_for_capture_program()


def executorch_backend_config():
    """to_executorch settings for static-llama programs: the runner owns the graph inputs/outputs (not memory-planned)
    and BuildQuantIo (private `_passes`) makes the tagged I/O really quantized."""
    from executorch.backends.qualcomm._passes.build_quant_io import BuildQuantIo
    from executorch.exir.capture._config import ExecutorchBackendConfig
    from executorch.exir.passes.memory_planning_pass import MemoryPlanningPass

    return ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, alloc_graph_output=False),
        passes=[BuildQuantIo()],
    )


@contextlib.contextmanager
def qnn_reexport_non_strict():
    """Inside this block, ExecuTorch's QNN lowering (`to_edge_transform_and_lower_to_qnn`) re-exports the converted
    graph non-strict, not with `strict=True` (dynamo).

    Why: the graph it re-exports is already the converted ATen GraphModule; tracing its generated code with dynamo
    took ~60% of the lowering's time before the edge passes (py-spy, SmolLM2's kv graph: 120 of the first 202 s),
    while a non-strict export of the same module is the same ATen graph (qexp's own QDQ export is non-strict for
    this reason). Private reach: it replaces the `torch.export.export` attribute upstream looks up at call time, for
    the block's duration. tests/test_htp.py::test_non_strict_reexport_gives_the_same_program checks the lowered
    program against upstream's strict path (same graph, bit-identical emulator outputs), and
    test_upstream_reexports_strict fails when upstream stops passing strict=True (then this patch can go).
    """
    import torch.export

    original = torch.export.export

    def export(*args, **kwargs):
        kwargs["strict"] = False
        return original(*args, **kwargs)

    torch.export.export = export
    try:
        yield
    finally:
        torch.export.export = original


@contextlib.contextmanager
def lazy_graph_module_recompile():
    """Inside this block, every new `torch.fx.GraphModule` is torch's `_LazyGraphModule`: `recompile()` marks the
    module's Python code stale and the code is generated when it is first read or called, not on every call.

    Why: ExecuTorch's edge passes and QNN's pass managers call `recompile()` after each pass, and each regenerates and
    `exec`s the Python source of a ~10k-node graph; most of those sources are never run (the next pass walks the graph
    with an Interpreter). py-spy on SmolLM2's two lowerings (in turn): 190 of 586 s in `GraphModule.recompile`.
    The graphs and therefore the program are unchanged; only when the source is generated changes (torch's inductor
    uses the same class for the same reason). torch's own switch, `_use_lazy_graph_module(True)`, reaches only graph
    modules made through `_make_graph_module`; ExecuTorch and torch.export construct `GraphModule(...)` directly, hence
    the `__new__` patch. Private reach: `torch.fx._lazy_graph_module` (not backward-compatible
    API) and `GraphModule.__new__`, which picks the per-instance class; patched for the block's duration.
    tests/test_htp.py::test_lazy_recompile_gives_the_same_program checks the lowered program against the eager one
    (same size and delegation, bit-identical emulator outputs).
    """
    from torch.fx import graph_module
    from torch.fx._lazy_graph_module import _LazyGraphModule

    original = graph_module.GraphModule.__new__

    def new(cls, *args, **kwargs):
        if cls is graph_module.GraphModule:
            cls = _LazyGraphModule
        return original(cls, *args, **kwargs)

    graph_module.GraphModule.__new__ = new
    try:
        yield
    finally:
        graph_module.GraphModule.__new__ = original


# ---------------------------------------------------------------- ExecuTorch Qualcomm: 4-bit weight lowering
@contextlib.contextmanager
def lower_4bit_per_channel_as_lpbq():
    """While active, QNN lowering encodes symmetric per-channel 4-bit weights as LPBQ (BLOCKWISE_EXPANSION) with one
    block per output channel, instead of QNN's per-channel 4-bit encoding (BW_AXIS_SCALE_OFFSET).

    Why: with 16-bit activations HTP's per-channel 4-bit kernels drop the accumulator's low 8 bits with a floor
    before requantizing; with scales of absmax/7 one accumulator unit is large in output terms, and SmolLM2's 16a4w
    landed +12% above its QDQ program. Through the LPBQ path the kernel sees 16 * w_q at scale / 16: the same
    integers and the same effective scale (ExecuTorch's per-block config quantizes each block scale to
    round(scale / (scale / 16)) = 16 exactly), so the QDQ program and the .pte size do not change.
    Reaches ExecuTorch's NodeVisitor.make_qnn_per_channel_config / make_qnn_per_block_config (builders, no public
    hook for the weight encoding).
    """
    from executorch.backends.qualcomm.builders.node_visitor import NodeVisitor
    from executorch.backends.qualcomm.utils.constants import (
        QCOM_DTYPE,
        QCOM_QUANT_MAX,
        QCOM_QUANT_MIN,
        QCOM_SCALE,
        QCOM_SCALES,
        QCOM_ZERO_POINTS,
    )

    per_channel = NodeVisitor.make_qnn_per_channel_config

    def make_config(self, node, quant_attrs):
        four_bit = quant_attrs[QCOM_DTYPE] == torch.int8 and \
            quant_attrs[QCOM_QUANT_MAX] - quant_attrs[QCOM_QUANT_MIN] <= 15
        zero_points = torch.as_tensor(quant_attrs[QCOM_ZERO_POINTS])
        user = self.get_first_user(node)
        # Convolutions only (the static llama's linears are 1x1 convs): QNN 2.49's HTP cannot prepare a block-wise
        # FullyConnected (`no properties registered for q::GenPad`).
        if not (four_bit and bool((zero_points == 0).all()) and "convolution" in str(user.target)):
            return per_channel(self, node, quant_attrs)
        scales = torch.as_tensor(quant_attrs[QCOM_SCALES], dtype=torch.float32).reshape(-1, 1)
        return self.make_qnn_per_block_config(node, {**quant_attrs, QCOM_SCALE: scales})

    NodeVisitor.make_qnn_per_channel_config = make_config
    try:
        yield
    finally:
        NodeVisitor.make_qnn_per_channel_config = per_channel


# ---------------------------------------------------------------- ExecuTorch LLM export
def export_llama(llm_config) -> None:
    """ExecuTorch's LLM export (`export_llama_lib._export_llama`, what the export_llama CLI calls) for a config
    object, without going through its argument parser."""
    from executorch.examples.models.llama.export_llama_lib import _export_llama

    _export_llama(llm_config)
