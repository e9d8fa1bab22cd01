"""The private ExecuTorch APIs qexp reaches into to run and inspect .pte programs, in one place.

Each function here wraps a name with a leading underscore (or a private module such as `_passes`) that upstream may
change without notice; the comment says why qexp needs it. When a version bump breaks one, the qexp/upstream/private*.py
modules are the only files to fix: private.py (lowering and exporting programs), private_quantize.py (quantizing:
torchao's prepare, SpinQuant, SeqMSE, QNN's quantizer) and private_runtime.py (running and inspecting .pte programs).
Public upstream names are re-exported by qexp/upstream/__init__.py.
"""

from __future__ import annotations

import contextlib


# ---------------------------------------------------------------- ExecuTorch runtime (pybindings)
def load_program(path: str, enable_etdump: bool = False, debug_buffer_size: int = 0):
    """A .pte as an ExecuTorch module through the pybindings (`_load_for_executorch` is their only loader); with
    `enable_etdump`, its runs are traced into an ETDump (and delegates' intermediate outputs into a debug buffer of
    `debug_buffer_size` bytes) that `write_etdump_result_to_file` writes out."""
    # llama::fallback.out, the CPU identity op between the QNN contexts of a sharded program (backend.num_sharding):
    # registered into the pybindings' kernel registry by loading ExecuTorch's custom-ops library
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    return _load_for_executorch(str(path), enable_etdump=enable_etdump, debug_buffer_size=debug_buffer_size)


def set_runtime_threads(threads: int) -> int:
    """Size the pybindings' thread pool (XNNPACK kernels use it); returns the count in effect."""
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(int(threads))
    return int(portable_lib._threadpool_get_thread_count())


# ---------------------------------------------------------------- ExecuTorch devtools: Inspector
@contextlib.contextmanager
def inspector_skipping_unmatched_outputs():
    """Inside this block, ExecuTorch's Inspector.calculate_numeric_gap skips a runtime event it cannot match to one
    output of the reference graph, instead of failing on all of them.

    Why: a QNN program's intermediate-output dump logs an op with several outputs (the static llama's final output
    node: logits and every KV cache) under a debug handle shorter than its output count, and upstream indexes the
    handle by output (`_combine_aot_overlapped_intermediate_outputs`, IndexError: tuple index out of range) before
    checking. Those events are the graph's outputs, compared with the logits anyway. Private reach:
    `executorch.devtools.inspector._inspector_utils`, patched for the block's duration; the events it skipped are
    counted in the list it yields (diagnostics/diag_htp_ops.py prints the count)."""
    import executorch.devtools.inspector._inspector_utils as inspector_utils

    original = inspector_utils._combine_aot_overlapped_intermediate_outputs
    skipped = []

    def combine(aot_nodes, runtime_node, negative_index):
        if -negative_index > len(runtime_node[0]):
            skipped.append(runtime_node[0])
            return (-1,), None
        return original(aot_nodes, runtime_node, negative_index)

    inspector_utils._combine_aot_overlapped_intermediate_outputs = combine
    try:
        yield skipped
    finally:
        inspector_utils._combine_aot_overlapped_intermediate_outputs = original


def set_inspector_reference_graph(inspector, name: str, exported_program) -> None:
    """Make `exported_program` the Inspector's reference graph `name` (what calculate_numeric_gap(reference_graph=
    name) runs on the representative inputs).

    Why: an ETRecord read back from its file has lost the nodes' QNN encodings (`quant_attrs` meta), which the
    reference graph needs to be made the QDQ program again (diagnostics/diag_htp_ops.py: requantize_activations), and
    an Inspector cannot be given the in-memory ETRecord instead (its operator-graph builder fails on the
    in-memory graphs' tuple arguments). Private reach: the Inspector's `_etrecord.graph_map`."""
    inspector._etrecord.graph_map[name] = exported_program
