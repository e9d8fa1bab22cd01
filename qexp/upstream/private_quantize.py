"""The private torchao / ExecuTorch APIs qexp reaches into to quantize models, in one place.

Each function here wraps a name with a leading underscore (or a private module such as `_passes`) that upstream may
change without notice; the comment says why qexp needs it. When a version bump breaks one, the qexp/upstream/private*.py
modules are the only files to fix: private.py (lowering and exporting programs), private_quantize.py (quantizing:
torchao's prepare, SpinQuant, SeqMSE, QNN's quantizer) and private_runtime.py (running and inspecting .pte programs).
Public upstream names are re-exported by qexp/upstream/__init__.py.
"""

from __future__ import annotations

import dataclasses


# ---------------------------------------------------------------- torchao
def forget_prepared_modules() -> None:
    """torchao 0.18's `prepare_pt2e` looks up a module's device through `torchao.utils._assert_and_get_unique_device`,
    a `functools.cache` keyed by the module: every prepared graph, weights included, stayed alive for the life of the
    process (convert_pt2e calls it too). A sweep's process grew by ~1.5 GB per SmolLM2 job (16 GB after 10 jobs). qexp
    clears it after each prepare and convert; the cached value is only needed during that call."""
    import torch.ao.quantization.fx.utils
    import torchao.utils

    # torch's own copy (torch.ao.quantization.fx.utils.assert_and_get_unique_device) is cached the same way
    for cached in (getattr(torchao.utils, "_assert_and_get_unique_device", None),
                   getattr(torch.ao.quantization.fx.utils, "assert_and_get_unique_device", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _shallow_observer_kwargs(quant_spec):
    """torchao's prepare builds observer kwargs with `deepcopy(asdict(spec))`, copying also the observer constructor
    it then discards. QNN's constructors reach an fx graph, so every call deep-copied the whole graph: 38 of 59 s of
    prepare_pt2e on SmolLM2. The other fields are immutable (dtype, ints, qscheme, floats): a field dict is the
    same kwargs."""
    return {f.name: getattr(quant_spec, f.name) for f in dataclasses.fields(quant_spec)}


def speed_up_prepare() -> None:
    """Replace torchao's private `prepare._get_observer_kwargs` with the shallow version above (same result)."""
    from torchao.quantization.pt2e import prepare

    prepare._get_observer_kwargs = _shallow_observer_kwargs


def spinquant_rotate(module, r1: bool, r2: bool, seed: int, device="cpu") -> None:
    """R1 / R2 rotations of torchao's SpinQuant (prototype.spinquant) on ExecuTorch's Meta-named Llama module, in
    place, without the embedding mean-centring and with seeded Hadamard signs. The module may be on another
    `device`; the Hadamard matrices are drawn with the CPU's generator (a CUDA generator draws other signs for the
    same seed) and moved there.

    Private reach: torchao's public `apply_spinquant` centres the embeddings (function-changing for RMSNorm models)
    and fixes the Hadamard seed at 0, so the fusing and rotating steps are called directly (`_rotate_model_r1/_r2`).
    Tested by tests/test_algorithms.py (float logits unchanged after rotation), which fails if these change.
    """
    import contextlib
    import io
    import types

    import torch
    from torchao.prototype.spinquant import spinquant as sq
    from torchao.prototype.spinquant.hadamard_utils import random_hadamard_matrix

    params = module.layers[0].attention
    dim = module.tok_embeddings.weight.shape[1]
    module.config = types.SimpleNamespace(dim=dim, head_dim=params.head_dim, n_local_heads=params.n_kv_heads,
                                          intermediate_size=module.layers[0].feed_forward.w1.weight.shape[0])
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # torchao prints a note on its slow Hadamard
        if r1:
            embedding = module.tok_embeddings.weight.data.clone()
            sq.fuse_layernorm_into_linear(module, qkv_split=True)
            module.tok_embeddings.weight.data = embedding  # undo the centring
            sq._rotate_model_r1(module, random_hadamard_matrix(dim, "cpu", seed=seed).to(device), qkv_split=True)
        if r2:
            r2s = [random_hadamard_matrix(module.config.head_dim, "cpu", seed=seed + 1 + i).to(device)
                   for i in range(len(module.layers))]
            sq._rotate_model_r2(module, r2s, qkv_split=True)
    del module.config


# ---------------------------------------------------------------- ExecuTorch Qualcomm: passes
def quantizer_keeping_hadamard_matmul(qnn_quantizer_cls):
    """A QnnQuantizer subclass that leaves the R3 Hadamard rotation a plain matmul.

    Upstream's HTP annotation passes (private `_passes`) include RecomposeHadamard, which (QNN >= 2.47) turns the
    rotation into QNN's HadamardTransform op. With the QNN 2.49 x86 libraries, HTP graph preparation cannot build
    the q-side one in an AR-N prefill graph (`could not create op: q::ConvLayer_s1.opt`), and the op accepts only
    16-bit activations. Without the pass the rotation stays a matmul with the same weights: same math, buildable.
    """
    from executorch.backends.qualcomm._passes import RecomposeHadamard
    from executorch.backends.qualcomm._passes.backends.htp.qnn_htp_pass_manager import QnnHtpPassManager

    class PassesWithoutHadamardRecompose(QnnHtpPassManager):
        @classmethod
        def get_annotation_passes(cls):
            return [p for p in super().get_annotation_passes() if p is not RecomposeHadamard]

    class QnnQuantizerKeepingHadamardMatmul(qnn_quantizer_cls):
        def transform_for_annotation(self, model):
            return PassesWithoutHadamardRecompose().transform_for_annotation_pipeline(model)

    return QnnQuantizerKeepingHadamardMatmul


def seq_mse_search(prepared, forward, candidates: int):
    """Run ExecuTorch's SeqMSE on `prepared` for one `forward()`; returns [(weight observer, best scale factor)] and
    leaves the observers unpatched (qexp bakes the factor into their range: qexp/transforms/seq_mse.py).

    Private reach: `executorch.backends.qualcomm._passes` (SeqMSE, SeqMseModule) and the method SeqMSE patches onto
    each observer. Tested by tests/test_algorithms.py (the searched scales reach the QDQ program), which fails if
    the pass changes how it reports its result.
    """
    from executorch.backends.qualcomm._passes import SeqMSE
    from executorch.backends.qualcomm._passes.seq_mse import SeqMseModule

    with SeqMSE(prepared, candidates):
        forward()
    found = []
    for name, module in list(prepared.named_children()):
        if isinstance(module, SeqMseModule):
            observer = module.observer
            observer.__dict__.pop("calculate_qparams", None)  # the instance patch RemoveSeqMse added
            found.append((observer, float(module.best_candidate_step)))
            delattr(prepared, name)  # it holds a copy of the weight
    return found


# ---------------------------------------------------------------- converting with less memory
ROWS_PER_CHUNK = 4096  # rows of a weight quantized at a time when folding (a 1B model's embedding has 128,256)


def convert_in_chunks(prepared):
    """`convert_pt2e(prepared)` that folds each weight's quantize op without computing what it need not: the same
    program (the integers and the graph convert_pt2e makes), without its transient float copies of the weights.

    torchao's constant folding computes every node whose inputs are constant before deciding whether to fold it, so
    each weight's dequantize op (which stays in the graph) is run once and thrown away: a float copy of every weight
    with the op's temporaries. On the `shape_llama3_2_1b` preset that made convert's peak 12.4 GiB over 7.2 GiB before
    it (measured). Here a dequantize node is never computed (its value is unknown to the folder, as its purity check
    would leave it), and each quantize op runs a block of rows at a time (`_in_row_chunks`: the decomposed ops quantize
    each element on its own, so the integers are the same).

    Private reach: torchao's `ConstantFolder` and `replace_node_with_constant` (its constant folding, which names the
    integer weights `_frozen_paramN`, as convert does) and `_quant_node_constraint` (which quantize ops convert folds);
    the body of `_fold` is torchao 0.18's `constant_fold`. Tested by tests/test_quantize.py (the program's integers
    and outputs equal convert_pt2e's), which fails if these change."""
    from torchao.quantization.pt2e.quantize_pt2e import _quant_node_constraint, convert_pt2e

    model = convert_pt2e(prepared, fold_quantize=False)
    chunked = {}
    for node in model.graph.nodes:
        if _quant_node_constraint(node):
            chunked.setdefault(node.target, _in_row_chunks(node.target))
            node.target = chunked[node.target]
    folded = set(chunked.values())
    _fold(model, lambda n: n.op == "call_function" and n.target in folded)
    for node in model.graph.nodes:  # a quantize op left unfolded (an activation's) gets its own op back
        if node.op == "call_function" and node.target in folded:
            node.target = node.target.op
    model.recompile()
    return model


def _fold(gm, constraint_fn) -> None:
    import torch
    from torchao.quantization.pt2e.constant_fold import ConstantFolder, replace_node_with_constant

    dequantize_ops = {torch.ops.quantized_decomposed.dequantize_per_channel.default,
                      torch.ops.quantized_decomposed.dequantize_per_tensor.default,
                      torch.ops.quantized_decomposed.dequantize_per_tensor.tensor,
                      torch.ops.torchao.dequantize_affine}

    class Folder(ConstantFolder):
        def run_node(self, node):
            if node.op == "call_function" and node.target in dequantize_ops:
                return self.unknown_value  # stays in the graph: its float result is never needed here
            return super().run_node(node)

    with torch.utils._python_dispatch._disable_current_modes():
        cf = Folder(gm, skip_constructors=True)
        cf.run()
        for node, constant in cf.node_replacements.items():
            if constraint_fn(node):
                replace_node_with_constant(gm, node, constant)
        erased = []
        for node in gm.graph.find_nodes(op="get_attr"):
            if len(node.users) == 0:
                if hasattr(gm, node.target):
                    delattr(gm, node.target)
                erased.append(node)
        for node in erased:
            gm.graph.erase_node(node)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()


class _in_row_chunks:
    """A quantize op applied to rows [i, i + ROWS_PER_CHUNK) of its input at a time, when its parameters are one
    value (per tensor) or one per row (per channel on axis 0, or per block with one row per block); whole otherwise."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"in_row_chunks_{getattr(op, '__name__', 'op')}"

    def __call__(self, x, *args, **kwargs):
        import torch

        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] <= ROWS_PER_CHUNK or kwargs:
            return self.op(x, *args, **kwargs)
        per_row = self._per_row_arguments(x, args)
        if per_row is None:
            return self.op(x, *args)
        out = None
        for start in range(0, x.shape[0], ROWS_PER_CHUNK):
            rows = slice(start, start + ROWS_PER_CHUNK)
            part = self.op(x[rows], *[a[rows] if i in per_row else a for i, a in enumerate(args)])
            if out is None:
                out = torch.empty(x.shape, dtype=part.dtype)
            out[rows] = part
        return out

    def _per_row_arguments(self, x, args):
        """Indexes of `args` to slice with the rows; None when the op's parameters do not split by rows."""
        import torch

        name = str(self.op)
        if "quantize_per_tensor" in name:
            return set() if all(not isinstance(a, torch.Tensor) or a.numel() == 1 for a in args) else None
        if "quantize_per_channel" in name:  # (scales, zero_points, axis, ...)
            return {0, 1} if args[2] == 0 and args[0].shape[0] == x.shape[0] else None
        if "quantize_affine" in name:  # (block_size, scale, zero_point, ...)
            block, scale, zero_point = args[0], args[1], args[2]
            rows_ok = block[0] == 1 and scale.dim() == x.dim() and scale.shape[0] == x.shape[0]
            zp_ok = zero_point is None or (zero_point.dim() == x.dim() and zero_point.shape[0] == x.shape[0])
            return ({1} | ({2} if zero_point is not None else set())) if rows_ok and zp_ok else None
        return None
