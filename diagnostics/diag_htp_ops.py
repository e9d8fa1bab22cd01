"""Diagnostic: where an HTP program departs from its QDQ program, op by op.

One prefill (AR-N) graph of a config's QDQ program is lowered with QNN's intermediate-output dump
(`dump_intermediate_outputs`), run on the emulator on the first N tokens of the first evaluation window (an empty
KV cache), and every op's output is compared with the same op of the CPU QDQ program by ExecuTorch's QNN debugger
(Inspector.calculate_numeric_gap with a QcomSQNRComparator scoring the dequantized HTP tensor against the CPU one by
the median over token positions of each position's SQNR in dB: qexp.eval.compare.per_position_sqnr_db says why
not the whole tensor's). The reference is the edge graph the lowering started from with its activations quantized
again (QNN's passes fold them into encodings, which would leave float activations: requantize_activations). An op's
SQNR is cumulative (each side computes from its own inputs), so the table also gives each op's *drop*: how far its
SQNR falls below the worst SQNR of the compared ops it reads (negative when the op hides its inputs' differences, as
a norm or a sigmoid can). Prints the largest drops, the worst SQNR per decoder layer and per kind of op, and the logits'
agreement (also the deployed program's, on the same tokens); the whole table goes to MLflow (experiment
`benchmarks`) as a CSV artifact. Emulator figures: `x86_emulator`.

Each op's *own* departure (`local_*` columns, local_departures): the reference recomputes every op from HTP's dumped
inputs, so an op is charged only with what its kernel does, in steps (LSB) of its output encoding: the share of
outputs that differ, the rms and mean difference (the mean is a bias: HTP's 16-bit RMSNorm floors, -1/2 step, which
eval.htp_exact models) and the largest. Printed per kind of op, per module (layers pooled) and for the largest, next
to what unbiased rounding noise of σ LSB would give (diagnostics/diag_qdq_perturb.py's units).

    .venv/bin/python diagnostics/diag_htp_ops.py [--top 25] [hydra overrides, e.g. model=gemma3_270m quant=16a4w]

The program differs from the deployed one on purpose in that its one method is named `forward` (the Inspector reads
only that name), and in what QNN cannot fuse when every tensor is dumped: the script prints how far the two
programs' logits are apart (tiny model: identical; Gemma-3-270M 16a8w: 50.8 dB). Attention runs split per head as
deployed (MHA2SHA); per-head ops have no whole-tensor counterpart and are left out, and a row whose drop includes
them says `+heads`. SmolLM2 ~10 min, Gemma-3-270M ~8 min and ~13 GiB on this machine.

Read the reference check line first: it gives how far the reference (the QDQ program computed from the graph after
QNN's passes) is from the converted QDQ graph at the logits. Where that is no better than HTP's own agreement (Gemma-3
-270M: 17.8 dB at 16a4w against HTP's 16.2), the program amplifies rounding differences and per-op figures cannot
single out an HTP op (docs/research/2026-11-27-gemma-on-htp.md).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: pandas is imported where used (lazily)
    import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402
from diagnostics.sqnr import per_position_sqnr_db  # noqa: E402

METHOD = "forward"  # the only method name ExecuTorch's Inspector reads (its debug-handle map is keyed by it)
REFERENCE_GRAPH = f"edge_after_transform/{METHOD}"  # the QDQ edge graph before partitioning (etrecord graph_map)
LAYER = re.compile(r"layers\.(\d+)")
OP = re.compile(r"aten\.(\w+)\.")


def lower_with_dump(graph: dict, soc: str, w4_as_lpbq: bool):
    """One deploy graph (lower.deploy_graph's dict) -> (.pte bytes, the ETRecord), lowered as the deployed program
    is (lower.lower_graphs, the same 4-bit lowering) but with QNN's intermediate-output dump and one method named
    `forward`."""
    import contextlib

    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    from qexp import upstream
    from qexp.backends.htp.lower import lower_graphs
    from qexp.upstream.private import executorch_backend_config, lower_4bit_per_channel_as_lpbq

    spec = generate_qnn_executorch_compiler_spec(
        soc_model=getattr(upstream.QcomChipset, soc), backend_options=generate_htp_compiler_spec(use_fp16=False),
        shared_buffer=False, use_mha2sha=True, dump_intermediate_outputs=True)
    with lower_4bit_per_channel_as_lpbq() if w4_as_lpbq else contextlib.nullcontext():
        edge = lower_graphs({METHOD: {**graph, "spec": spec}}, generate_etrecord=True)
    program = edge.to_executorch(executorch_backend_config())
    return program.buffer, program.get_etrecord()


def requantize_activations(reference) -> dict:
    """Put the activation quantization back into the reference graph, in place; returns {op name: (the name of the
    dequantize node its users now read, its scale)}, one entry per tensor it quantizes.

    ExecuTorch's QNN passes fold every activation's quantize/dequantize pair into the producing node's encoding
    (FoldQDQ, `quant_attrs` in its meta) before the graph the Inspector runs as its reference, so that graph computes
    with float activations and quantized weights: compared with it, HTP would be charged with the activation
    quantization the CPU QDQ program has too. Each encoded node's output goes through quantize and dequantize again
    (the QDQ program's own ops), so the reference is the QDQ program; the node itself still reports its output
    before quantization, which differs from HTP's quantized one by the rounding only."""
    from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS

    ops = torch.ops.quantized_decomposed
    graph, requantized = reference.graph_module.graph, {}
    for node in list(graph.nodes):
        attrs = node.meta.get(QCOM_QUANT_ATTRS)
        value = node.meta.get("val")
        if not attrs or not isinstance(value, torch.Tensor) or not value.is_floating_point() or \
                "per_tensor" not in str(attrs["encoding"]):
            continue
        args = (attrs["scale"], attrs["zero_point"], attrs["quant_min"], attrs["quant_max"], attrs["dtype"])
        with graph.inserting_after(node):
            quantized = graph.call_function(ops.quantize_per_tensor.default, (node, *args))
        with graph.inserting_after(quantized):
            dequantized = graph.call_function(ops.dequantize_per_tensor.default, (quantized, *args))
        node.replace_all_uses_with(dequantized, delete_user_cb=lambda user: user is not quantized)
        requantized[node.name] = (dequantized.name, float(attrs["scale"]))
    reference.graph_module.recompile()
    return requantized


def first_chunk_inputs(ids, example_inputs: tuple, encodings: dict, context: int, sliding_window):
    """(the emulator's quantized inputs, the QDQ program's float inputs, N) for the first AR-N tokens on an empty
    cache, as qexp's HTP runner builds them (qexp/backends/htp/runner.py); shapes from the graph's example inputs
    (tokens, the mask(s), positions, the K caches, the V caches)."""
    from qexp.backends.htp.runner import PADDING_MASK_VALUE, mask_values

    ar = int(example_inputs[0].shape[-1])
    n_masks = 2 if "window_mask" in encodings else 1
    if sliding_window and int(sliding_window) < ar:
        raise SystemExit(f"the sliding window ({sliding_window}) is shorter than the AR-{ar} chunk")
    tokens = torch.as_tensor([list(ids[:ar])], dtype=torch.int32)
    positions = torch.arange(ar, dtype=torch.int32).reshape(1, ar)
    attend = torch.zeros((ar, context), dtype=torch.bool)
    attend[:, context - ar:] = torch.tril(torch.ones(ar, ar, dtype=torch.bool))  # the cache part is empty
    # with nothing cached, the sliding-window mask (Gemma 3) attends what the causal one does
    masks_q = []
    for name in ["mask", "window_mask"][:n_masks]:
        on, off, dtype = mask_values(encodings, name)
        masks_q.append(torch.where(attend, on, off).to(dtype).reshape(1, 1, ar, context))
    mask_f = torch.where(attend, 0.0, PADDING_MASK_VALUE).reshape(1, 1, ar, context)
    caches = example_inputs[2 + n_masks:]
    zero_points = [zp for _, zp in encodings["k"]] + [zp for _, zp in encodings["v"]]
    kv_dtype = torch.uint8 if encodings["kv_range"][1] <= 255 else torch.uint16
    caches_q = [torch.full(tuple(c.shape), zp, dtype=kv_dtype) for c, zp in zip(caches, zero_points)]
    caches_f = [torch.zeros(tuple(c.shape)) for c in caches]  # a zero point dequantizes to 0
    quantized = (tokens, *masks_q, positions, *caches_q)
    floats = (tokens, *[mask_f] * n_masks, positions, *caches_f)
    return quantized, floats, ar


def op_kind(node) -> str:
    """`convolution`, `_softmax`, `mul`, ...: the ATen op of an edge node, without namespace and overload."""
    found = OP.search(str(node.target))
    return found.group(1) if found else str(node.target)


def module_of(node) -> str:
    """The innermost module an edge node was traced in (e.g. `layers.8.post_attention_norm`), '' if unknown."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return stack[-1][0] if stack else ""


def layer_of(node) -> int | None:
    """The decoder layer an edge node belongs to, from its module stack (None outside the layers)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        found = LAYER.search(path)
        if found:
            return int(found.group(1))
    return None


def op_table(gaps, reference, split: set):
    """Inspector rows -> one row per compared op in graph order: op, kind, layer, SQNR, the worst SQNR of the
    compared ops it reads (walking back through ops that were not compared) and its drop below that. `split`: the
    ops left out because they run split per head; a row whose walk passed one has ` +heads` in its kind."""
    import pandas as pd

    nodes = {n.name: n for n in reference.graph.nodes}
    order = {name: i for i, name in enumerate(nodes)}
    sqnr = {}
    for _, row in gaps.iterrows():
        value = float(row.gap[0]) if len(row.gap) else float("nan")
        for name in row.aot_ops:
            sqnr[name] = value

    def worst_input(node, seen):
        """(the worst SQNR of the compared ops `node` reads, whether the walk passed a per-head op); inf: it reads
        only graph inputs and constants, which both sides have exactly."""
        worst, heads = math.inf, False
        for parent in node.all_input_nodes:
            if parent.name in seen:
                continue
            seen.add(parent.name)
            if parent.name in sqnr:
                worst = min(worst, sqnr[parent.name])
            elif parent.op == "call_function":  # an op without its own comparison: look through it
                below, below_heads = worst_input(parent, seen)
                worst, heads = min(worst, below), heads or below_heads or parent.name in split
        return worst, heads

    rows = []
    for name, value in sqnr.items():
        node = nodes[name]
        before, heads = worst_input(node, set())
        rows.append({"order": order[name], "op": name, "kind": op_kind(node) + (" +heads" if heads else ""),
                     "layer": layer_of(node), "module": module_of(node), "sqnr_db": value, "input_sqnr_db": before,
                     "drop_db": (before - value) if math.isfinite(before) else (math.inf if math.isfinite(value)
                                                                                   else 0.0)})
    return pd.DataFrame(rows).sort_values("order").reset_index(drop=True)


def htp_outputs(gaps, reference) -> dict:
    """{reference op name: HTP's output of it, dequantized, in PyTorch layout} from the Inspector's rows (one row per
    compared debug handle; a handle's tensor is its last op's output in graph order)."""
    order = {node.name: i for i, node in enumerate(reference.graph.nodes)}
    outputs = {}
    for _, row in gaps.iterrows():
        names = [name for name in row.aot_ops if name in order]
        value = row.runtime_intermediate_output
        if names and isinstance(value, torch.Tensor) and value.is_floating_point():
            outputs[max(names, key=order.get)] = value.detach().float()
    return outputs


def local_departures(module: torch.fx.GraphModule, outputs: dict, requantized: dict, floats: tuple, tokens: int):
    """Each compared op recomputed by the CPU QDQ program on HTP's own inputs, against HTP's output: the kernel's
    departure alone, not what it inherits (the table's SQNR is cumulative, and on a fragile program such as
    Gemma-3-270M's the inherited part swamps it).

    `module` is the reference graph (activations requantized) as a module (ExportedProgram.module()); it runs in an
    FX interpreter in which every tensor HTP dumped replaces the CPU's value for the ops that read it; an op HTP
    fused away is recomputed from its fused group's dumped inputs, so its departure is counted at the group's output,
    and the per-head attention ops (split per head, not compared) at the attention output's. Per op, in units of its
    output encoding's step (LSB): the share of values that differ, the rms and mean difference (HTP minus CPU: a
    kernel that rounds differently shows as rms, one that is biased as a mean) and the largest; and the local
    per-position SQNR (dB)."""
    import pandas as pd

    at = {}  # the node whose value HTP's replaces -> (the op, its output step or None)
    for name in outputs:
        dequantized, scale = requantized.get(name, (name, None))
        at[dequantized] = (name, scale)
    rows = []

    class TeacherForced(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node.name not in at:
                return value
            name, scale = at[node.name]
            htp = outputs[name]
            if not isinstance(value, torch.Tensor) or value.shape != htp.shape:
                return value
            cpu = value.float()
            row = {"op": name, "local_sqnr_db": per_position_sqnr_db(cpu, htp, tokens)}
            if scale:
                lsb = (htp - cpu).double() / scale
                row.update(local_changed=float((lsb.abs() > 0.5).double().mean()),
                           local_lsb_rms=float(lsb.pow(2).mean().sqrt()), local_lsb_mean=float(lsb.mean()),
                           local_lsb_max=float(lsb.abs().max()))
            rows.append(row)
            return htp.to(value.dtype)

    with torch.no_grad():
        TeacherForced(module).run(*floats)
    missing = set(outputs) - {row["op"] for row in rows}
    if missing:  # a dumped op the interpreter never met by name: the table would silently lack it
        raise RuntimeError(f"{len(missing)} compared ops not found in the reference module: {sorted(missing)[:5]}")
    return pd.DataFrame(rows)


def noise_lsb(sigma: float, samples: int = 1 << 20) -> tuple:
    """(share of values changed, rms difference in LSB) that rounding round(x/s + e), e ~ N(0, sigma^2), makes
    against round(x/s), x/s's fraction uniform: the local departures' yardstick, in diag_qdq_perturb.py's units."""
    generator = torch.Generator().manual_seed(0)
    fraction = torch.rand(samples, generator=generator, dtype=torch.float64) - 0.5
    moved = torch.round(fraction + sigma * torch.randn(samples, generator=generator, dtype=torch.float64))
    return float((moved != 0).double().mean()), float(moved.pow(2).mean().sqrt())


def sqnr_comparator(reference, tokens: int):
    """ExecuTorch's QNN comparator (dequantization and layout handled upstream) scoring each op by
    per_position_sqnr_db, on the ops whose HTP tensor is the whole of the reference op's: with attention split per
    head (MHA2SHA, as deployed), an op split into one op per head logs its first head's tensor under the whole op's
    debug handle. Those (per-head q/k/v, scores, softmax) are left out and counted; the attention's output,
    concatenated again, is compared."""
    from executorch.backends.qualcomm.debugger.qcom_numerical_comparator_sample import QcomSQNRComparator

    class WholeTensorSQNR(QcomSQNRComparator):
        def element_compare(self, a, b) -> float:  # a: the reference's output, b: HTP's
            return per_position_sqnr_db(a, b, tokens)

        def compare(self, mapping, aot_names, runtime_names):
            def whole(golden, htp):
                if isinstance(golden, torch.Tensor) and isinstance(htp, torch.Tensor):
                    return golden.numel() == htp.numel()
                return isinstance(golden, (tuple, list)) and isinstance(htp, (tuple, list)) and \
                    len(golden) == len(htp) and all(whole(g, h) for g, h in zip(golden, htp))

            kept = {aot: rt for aot, rt in mapping.items() if whole(aot[1], rt[1])}
            self.split_ops = [aot_names.get(aot[0], aot[0]) for aot in mapping if aot not in kept]
            return super().compare(kept, aot_names, runtime_names)

    return WholeTensorSQNR(edge_ep=reference)


def logits_agreement(htp_logits: torch.Tensor, cpu_logits: torch.Tensor) -> dict:
    """SQNR (dB) of `htp_logits` against `cpu_logits` (inf when equal) and the share of positions with the same
    top-1 token."""
    from qexp.eval.compare import sqnr_db

    return {"logits_sqnr_db": sqnr_db(cpu_logits, htp_logits),
            "top1_htp_vs_qdq": (htp_logits.argmax(-1) == cpu_logits.argmax(-1)).float().mean().item()}


@dataclass
class OpDiagnosis:
    table: "pd.DataFrame"  # one row per compared op (op_table)
    summary: dict  # logits' agreement, ops compared, timings
    htp_logits: torch.Tensor  # [AR-N, vocab], dequantized
    deployed_logits: torch.Tensor  # the deployed program's (compile_pte, cached) on the same tokens
    left_out: dict  # ops not compared and why: split per head (MHA2SHA), multi-output events


def diagnose(cfg) -> OpDiagnosis:
    """The whole diagnostic for one config (backend=htp, a prefill graph): lower, run, compare."""
    from executorch.devtools import Inspector

    from qexp.backends.htp.config import ModelMode, W4Lowering
    from qexp.backends.htp.lower import PREFILL_GRAPH, deploy_graph, compile_pte, graph_ar_lens
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.backends.htp.runner import HtpRunner
    from qexp.pipeline import prepare
    from qexp.core.provenance import library_versions
    from qexp.upstream.private import tree_leaves
    from qexp.upstream.private_runtime import (
        inspector_skipping_unmatched_outputs,
        load_program,
        set_inspector_reference_graph,
    )

    if cfg.backend.name != "htp" or cfg.backend.model_mode == ModelMode.kv:
        raise SystemExit("diag_htp_ops needs backend=htp with an AR-N prefill graph (model_mode hybrid or lookahead)")
    state = prepare(cfg, through="qdq")
    ensure_qnn_sdk(state.cache)
    stats = torch.load(state.qdq.program.stats_path, weights_only=True)
    started = time.perf_counter()
    graph = deploy_graph(state.deploy_model, cfg, PREFILL_GRAPH, graph_ar_lens(cfg.backend)[PREFILL_GRAPH],
                          state.deploy_static.r3, stats, state.timer)
    encodings = graph["encodings"]
    quantized, floats, ar = first_chunk_inputs(state.windows.ids[0], graph["inputs"], encodings,
                                               int(cfg.backend.max_seq_len), graph["meta"].get("get_sliding_window"))
    with torch.no_grad():  # the QDQ program the lowering starts from, on the same inputs: the reference's check
        qdq_logits = tree_leaves(graph["module"](*floats))[0].float().reshape(ar, -1)
    buffer, etrecord = lower_with_dump(graph, cfg.backend.soc.value, cfg.backend.w4_lowering == W4Lowering.lpbq)
    lower_s = time.perf_counter() - started
    reference = etrecord.graph_map[REFERENCE_GRAPH]
    del graph
    # The deployed program on the same tokens: QNN fuses ops it need not dump, so the dumped program can round
    # differently; how far the two programs' logits are apart says how much of the table is the deployed program's.
    deployed = compile_pte(state.deploy_model, cfg, state.qdq.program, state.deploy_static.r3, state.cache, state.timer,
                           library_versions())
    deployed_logits = HtpRunner(deployed).prefill_logits([int(t) for t in state.windows.ids[0][:ar]])
    del state, deployed

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "model.pte").write_bytes(buffer)
        del buffer
        # the debug buffer holds every dumped tensor of one call (SmolLM2's AR-32 graph: ~0.3 GB); pages it does not
        # use are never touched
        module = load_program(tmp / "model.pte", enable_etdump=True, debug_buffer_size=4 << 30)
        started = time.perf_counter()
        out = module.run_method(METHOD, quantized)
        run_s = time.perf_counter() - started
        module.write_etdump_result_to_file(str(tmp / "etdump.etdp"), str(tmp / "debug.bin"))
        scale, zero_point = encodings["logits"]
        htp_logits = (out[0].to(torch.float32).reshape(ar, -1) - zero_point) * scale
        del module, out
        etrecord.update_representative_inputs([floats])
        etrecord.save(str(tmp / "etrecord.bin"))
        inspector = Inspector(etdump_path=str(tmp / "etdump.etdp"), debug_buffer_path=str(tmp / "debug.bin"),
                              etrecord=str(tmp / "etrecord.bin"), reference_graph_name=REFERENCE_GRAPH)
        requantized = requantize_activations(reference)
        set_inspector_reference_graph(inspector, REFERENCE_GRAPH, reference)
        with inspector_skipping_unmatched_outputs() as skipped:
            comparator = sqnr_comparator(reference, ar)
            gaps = inspector.calculate_numeric_gap(distance=comparator, reference_graph=REFERENCE_GRAPH)
    with torch.no_grad():
        module = reference.module()  # unlifted once: the plain run and the one on HTP's inputs share it
        cpu_logits = module(*floats)[0].float().reshape(ar, -1)
    split = {name for names in comparator.split_ops for name in names}
    local = local_departures(module, htp_outputs(gaps, reference), requantized, floats, ar)
    table = op_table(gaps, reference, split).merge(local, on="op", how="left")
    summary = {**logits_agreement(htp_logits, cpu_logits), "ops_compared": len(table),
               **{f"deployed_{k}": v for k, v in logits_agreement(deployed_logits, cpu_logits).items()},
               "dumped_vs_deployed_logits_sqnr_db": logits_agreement(htp_logits, deployed_logits)["logits_sqnr_db"],
               "reference_vs_qdq_program_logits_sqnr_db": logits_agreement(cpu_logits, qdq_logits)["logits_sqnr_db"],
               "min_op_sqnr_db": float(table.sqnr_db[table.sqnr_db.map(math.isfinite)].min()),
               "lower_s": lower_s, "emulator_run_s": run_s, "tokens": ar, "activations_requantized": len(requantized)}
    stepped = table.local_lsb_rms.dropna()
    summary.update(local_ops=len(stepped), local_lsb_rms_median=float(stepped.median()),
                   local_lsb_rms_max=float(stepped.max()), local_ops_rms_over_half_lsb=int((stepped > 0.5).sum()))
    left_out = {"split_per_head": len(split), "multi_output_events": len(skipped)}
    return OpDiagnosis(table, summary, htp_logits, deployed_logits, left_out)


def local_summary(table, by: str):
    """Local departures (local_departures) aggregated by `by` (a column: `kind`, `role`), largest median rms first."""
    stepped = table.dropna(subset=["local_lsb_rms"])
    return stepped.groupby(by).agg(
        ops=("op", "count"), changed=("local_changed", "median"), rms_median=("local_lsb_rms", "median"),
        rms_max=("local_lsb_rms", "max"), mean_median=("local_lsb_mean", "median"),
        mean_min=("local_lsb_mean", "min"), mean_max=("local_lsb_mean", "max"),
        sqnr_median=("local_sqnr_db", "median")).sort_values("rms_median", ascending=False)


def print_local(table, top: int) -> None:
    yardstick = "; ".join(f"σ {sigma}: {changed:.0%} changed, rms {rms:.2f}"
                          for sigma in (0.125, 0.25, 0.5, 1.0) for changed, rms in [noise_lsb(sigma)])
    print(f"\nlocal departures: each op recomputed by the CPU QDQ program on HTP's own inputs, HTP minus CPU in "
          f"steps (LSB) of the op's output encoding (changed: share of values that differ; mean: the bias). Unbiased "
          f"rounding noise of σ LSB would give: {yardstick}")
    table = table.assign(role=table.module.str.replace(r"layers\.\d+", "layers.*", regex=True))
    print(f"\nper kind of op:\n{local_summary(table, 'kind').to_string(float_format='%.3f')}")
    print(f"\nper module (layers pooled):\n{local_summary(table, 'role').head(top).to_string(float_format='%.3f')}")
    shown = ["op", "kind", "module", "local_changed", "local_lsb_rms", "local_lsb_mean", "local_lsb_max",
             "local_sqnr_db"]
    largest = table.dropna(subset=["local_lsb_rms"]).nlargest(top, "local_lsb_rms")[shown]
    print(f"\nlargest local departures:\n{largest.to_string(index=False, float_format='%.3f')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=25, help="how many of the largest drops to print")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import mlflow
    import pandas as pd
    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp.tracking.address import resolve_uri

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=16a4w_wikitext", *args.overrides])
    result = diagnose(cfg)
    table, summary = result.table, result.summary

    label = f"{cfg.model.name} {cfg.quant.scheme} (w4_lowering={cfg.backend.w4_lowering.value})"
    pd.set_option("display.width", 200)
    print(f"\n{label}: HTP vs its QDQ program op by op, the first {summary['tokens']} tokens of window 0 "
          f"(target=x86_emulator)")
    print(f"  logits: {summary['logits_sqnr_db']:.1f} dB, top-1 agreement {summary['top1_htp_vs_qdq']:.3f}; "
          f"{len(table)} ops compared (left out: {result.left_out['split_per_head']} split per head, "
          f"{result.left_out['multi_output_events']} multi-output events)")
    print(f"  the deployed program on the same tokens: {summary['deployed_logits_sqnr_db']:.1f} dB, top-1 agreement "
          f"{summary['deployed_top1_htp_vs_qdq']:.3f}; dumped vs deployed logits "
          f"{summary['dumped_vs_deployed_logits_sqnr_db']:.1f} dB (QNN fuses ops it need not dump)")
    print(f"  reference: the QDQ program ({summary['activations_requantized']} activations requantized after QNN's "
          f"passes), its logits {summary['reference_vs_qdq_program_logits_sqnr_db']:.1f} dB from the converted "
          f"graph's")
    shown = ["op", "kind", "module", "input_sqnr_db", "sqnr_db", "drop_db"]
    finite = table[table.drop_db.map(math.isfinite)]
    largest = finite.nlargest(args.top, "drop_db")[shown].to_string(index=False, float_format="%.1f")
    print(f"\nlargest drops (an op's SQNR below the worst of its compared inputs'; `+heads`: the drop includes the "
          f"per-head ops before it):\n{largest}")
    by_layer = table.dropna(subset=["layer"]).groupby("layer").sqnr_db.min()
    print(f"\nworst SQNR per decoder layer (dB):\n{by_layer.to_frame().T.to_string(float_format='%.1f')}")
    by_kind = finite.groupby("kind").drop_db.agg(["count", "median", "max"]).sort_values("max", ascending=False)
    print(f"\ndrop per kind of op (dB):\n{by_kind.to_string(float_format='%.1f')}")
    print_local(table, args.top)

    with benchmark_run(resolve_uri(cfg.tracking), f"diag_htp_ops-{cfg.model.name}-{cfg.quant.scheme}",
                       "diag_htp_ops", {"target": "x86_emulator", "model": cfg.model.name,
                                        "scheme": cfg.quant.scheme, "w4_lowering": cfg.backend.w4_lowering.value}):
        mlflow.log_metrics({**summary, **{f"left_out_{k}": v for k, v in result.left_out.items()}})
        mlflow.log_text(table.to_csv(index=False), "diag_htp_ops.csv")


if __name__ == "__main__":
    main()
