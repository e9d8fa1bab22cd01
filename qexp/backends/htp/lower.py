"""Lower stage: the calibrated model -> the static-llama graphs the runner needs -> one HTP-delegated .pte.

Graphs: `kv_forward` (AR-1, or the lookahead width) and, for hybrid/lookahead, `prefill_forward` (AR-N). Each is
the same static llama as the calibration graph with another AR length. It is exported the same way, prepared with
the same quantizer, and given the calibration graph's observer statistics (cached with the QDQ program) before
convert_pt2e: so it carries exactly the encodings the QDQ phase evaluated, without calibrating again. The cache
inputs take the encodings of the matching cache outputs (the runner writes outputs back into inputs unchanged).

Upstream's HybridTextDecoder._encoding_override does this by walking both graphs in parallel; with torch 2.13's
exported modules (a `_guards_fn` node, non-strict placeholder names) its checks fail, so qexp transfers observer
state instead, which needs no node matching beyond the observers' own (identical) names.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import torch

from qexp.backends.htp import sim_cycles
from qexp.backends.htp.config import Contexts, ModelMode
from qexp.backends.htp.graph import check_one_kv_cache_width, io_bits, io_encodings, quantized_graph
from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
from qexp.backends.htp.sharding import check_num_sharding, shard_graph
from qexp.cache import Cache, stable_hash
from qexp.core.config import FLOAT_ACTIVATION_SCHEME
from qexp.models.loaded import LoadedModel
from qexp.models.static_llama import uses_masked_softmax
from qexp.quant.calibrate import QuantizedModel
from qexp.quant.w4_lowering import W4Lowering
from qexp.core.timing import StageTimer, release_memory
from qexp.upstream.private import (
    executorch_backend_config,
    lazy_graph_module_recompile,
    lower_4bit_per_channel_as_lpbq,
    provenance_without_deep_copies,
    signature_lookups_for_placeholders_only,
    qnn_reexport_non_strict,
    quant_io_passes,
)

log = logging.getLogger("qexp")

KV_GRAPH = "kv_forward"
PREFILL_GRAPH = "prefill_forward"
PTE_FILE = "model.pte"
META_FILE = "meta.json"
_LOWER_CACHE_VERSION = 2  # 2: I/O bit widths from the encodings


def graph_ar_lens(backend) -> Dict[str, int]:
    """AR length of each graph for a model mode (as upstream's process_model_args)."""
    if backend.model_mode == ModelMode.kv:
        return {KV_GRAPH: 1}
    if backend.model_mode == ModelMode.hybrid:
        return {KV_GRAPH: 1, PREFILL_GRAPH: int(backend.prefill_ar_len)}
    width = (backend.window + backend.gcap) * (backend.ngram - 1)
    return {KV_GRAPH: 2 ** math.ceil(math.log2(max(width, 1))), PREFILL_GRAPH: int(backend.prefill_ar_len)}


def compile_workers(backend, n_graphs: int) -> int:
    """Processes that lower the graphs at once: backend.compile_workers, at most one per graph and per CPU core."""
    return max(1, min(int(backend.compile_workers), n_graphs, os.cpu_count() or 1))


def _room_for_workers(n_workers: int) -> bool:
    """Whether the machine has memory for forked compile workers. A worker's peak, measured when the parent forked
    with both graphs built: SmolLM2 ~3 GB of its own beyond the pages it shares with the parent; the Qwen2.5-0.5B
    shape 20.3 GB anonymous RSS against the parent's 12.3 GB at the fork (1.65x; the OOM killer took it with 11 GB
    free). A worker now builds its own graph after the fork, from a parent that holds none (SmolLM2: 1.5 GiB at the
    fork instead of 2.2), so its peak is a larger multiple of the parent's memory: asked for, 4x the parent's
    resident memory per worker. Without the room, the graphs are lowered one after the other (one warning says
    so)."""
    import psutil

    need = 4 * n_workers * psutil.Process().memory_info().rss
    available = psutil.virtual_memory().available
    if available >= need:
        return True
    log.warning("lowering the graphs one after the other: %.1f GiB of memory available, %.1f GiB wanted for %d "
                "compile worker(s) (the same program; backend.compile_workers=1 avoids this check)",
                available / 2**30, need / 2**30, n_workers)
    return False


@dataclass
class DeployedProgram:
    pte_path: Path
    meta: dict  # graphs, AR lengths, layer/head shapes, logits and KV I/O encodings
    key: str
    cache_hit: bool

    @property
    def pte_bytes(self) -> int:
        return self.pte_path.stat().st_size


def compile_pte(
    model: LoadedModel, cfg, qdq: QuantizedModel, r3: bool, cache: Cache, timer: StageTimer, versions: dict
) -> DeployedProgram:
    """The graphs the model mode needs, quantized with the calibration's encodings, lowered into one .pte (cached)."""
    sdk = ensure_qnn_sdk(cache)
    backend = cfg.backend
    if backend.soc.value in sim_cycles.SOCS:  # before ExecuTorch creates its QNN backend (and before any fork)
        sim_cycles.install(str(sdk.lib_dir / "libQnnHtp.so"))
    context = int(backend.max_seq_len)
    ar_lens = graph_ar_lens(backend)
    per_graph = backend.contexts == Contexts.per_graph and len(ar_lens) > 1
    key = stable_hash({
        "version": _LOWER_CACHE_VERSION, "qdq": qdq.key, "soc": backend.soc.value, "ar_lens": ar_lens,
        "context": context, "w4_lowering": backend.w4_lowering.value, "qnn": sdk.version, "versions": versions,
        # a QNN context per graph or one shared by all graphs: a different program layout (how many processes
        # lower the graphs is not: compile_workers is a speed setting and shares the cache entry)
        **({"contexts": "per_graph"} if per_graph else {}),
        **({"num_sharding": backend.num_sharding} if backend.num_sharding > 1 else {}),
    }, length=24)
    check_num_sharding(backend.num_sharding, model.params["n_layers"])  # validation could not if the metadata is mute

    def build(tmp: Path) -> dict:
        stats = torch.load(qdq.stats_path, weights_only=True)
        # Each graph is built where it is lowered: in a compile worker, the worker builds its own graph while this
        # process builds the first (the same function on the same inputs, so the same graph), and no process holds
        # a graph it does not lower.
        builders = {name: functools.partial(deploy_graph, model, cfg, name, ar_len, r3, stats, timer)
                    for name, ar_len in ar_lens.items()}
        with provenance_without_deep_copies():  # same program, without quadratic copies of node provenance
            workers = compile_workers(backend, len(ar_lens)) if per_graph else 0
            buffer, delegation, used, graphs = build_and_lower(builders, timer, backend.w4_lowering == W4Lowering.lpbq,
                                                      workers)
        first = next(iter(graphs.values()))
        (tmp / PTE_FILE).write_bytes(buffer)
        meta = {
            "graphs": ar_lens, "context": context, "n_layers": model.params["n_layers"],
            "kv_bits": io_bits(first["encodings"]["kv_range"]),
            "encodings": {name: g["encodings"] for name, g in graphs.items()}, "delegation": delegation,
            "soc": backend.soc.value, "qnn": sdk.version, "qdq_key": qdq.key,
            "sliding_window": first["meta"].get("get_sliding_window"),
            # QNN's DDR bandwidth summary of one call of each graph (None: not told apart), for the speed estimate
            "ddr": {name: g.get("ddr") for name, g in graphs.items()},
            # QNN's simulated cycles of one call of each graph (SoCs it simulates only: qexp/backends/htp/sim_cycles.py)
            "sim": {name: g.get("sim") for name, g in graphs.items()},
            "lowering": {"workers": max(used, 1), "contexts": "per_graph" if per_graph else "shared",
                         "num_sharding": backend.num_sharding},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        return {"pte_bytes": len(buffer)}

    path, hit = cache.get_or_build("pte", key, build)
    log.info("HTP program %s (%s)", path / PTE_FILE, "cache hit" if hit else "compiled")
    return DeployedProgram(path / PTE_FILE, json.loads((path / META_FILE).read_text()), key, hit)


def deploy_graph(model: LoadedModel, cfg, name: str, ar_len: int, r3: bool, stats: dict, timer: StageTimer) -> dict:
    """One graph (kv_forward / prefill_forward): quantized with the calibration's encodings, with its lowering
    passes (upstream's I/O tagging) and compiler spec."""
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    from qexp import upstream

    backend = cfg.backend
    context = int(backend.max_seq_len)
    started = time.perf_counter()
    with timer.stage(f"quantize_{name}"):
        converted, static = quantized_graph(
            model, context, ar_len, r3, cfg.quant, cfg.observer, stats, cfg.model.recompose_hadamard, backend.soc.value,
            masked_softmax=uses_masked_softmax(cfg.model),
        )
    meta = static.module.get_metadata()
    check_one_kv_cache_width(converted, static.n_layers)
    encodings = io_encodings(converted, static.n_layers, static.n_masks)
    # The KV caches, logits and mask keep the bit width of their own encodings at the graph's edge. Upstream decides
    # it from the recipe (16-bit I/O unless 8a8w or annotate_kv_8bit), which fits its recipes only: an 8-bit output
    # tagged uint16 gave garbage logits (8a8w: ppl 1e110), and 8a4w's 8-bit caches tagged uint16 top-1 0.09.
    kv_type = torch.uint8 if io_bits(encodings["kv_range"]) == 8 else torch.uint16
    io_type = torch.uint8 if io_bits(encodings["logits_range"]) == 8 else torch.uint16
    passes, deps = quant_io_passes(meta, cfg.model.arch, ar_len, context, kv_type, io_type)
    if backend.num_sharding > 1:
        shard_graph(passes, deps, static.n_layers, backend.num_sharding)
    spec = generate_qnn_executorch_compiler_spec(
        soc_model=getattr(upstream.QcomChipset, backend.soc.value),
        # float16 activations (fp16a8w) run as such on HTP only with its fp16 precision switched on
        backend_options=generate_htp_compiler_spec(use_fp16=cfg.quant.scheme == FLOAT_ACTIVATION_SCHEME,
                                                   use_weight_sharing=False,
                                                   use_multi_contexts=backend.num_sharding > 1),
        shared_buffer=False,  # the x86 emulator supports neither shared buffers nor weight sharing
        use_mha2sha=True,
        # detailed profiling is what makes HTP's prepare simulate the graph (its emulator runs get slower)
        profile_level=sim_cycles.PROFILE_LEVEL if backend.soc.value in sim_cycles.SOCS else 0,
    )
    return {"module": converted, "inputs": static.example_inputs(), "passes": passes, "deps": deps, "spec": spec,
            "meta": meta, "encodings": encodings, "quantize_s": time.perf_counter() - started}


def lower_graphs(graphs: dict, constant_methods=None, generate_etrecord: bool = False):
    """Deploy graphs (deploy_graph's dicts, by method name) -> the HTP-delegated EdgeProgramManager, by upstream's
    one lowering call (one QNN context for all of them); with `generate_etrecord`, the manager keeps the ETRecord
    ExecuTorch's Inspector reads (diagnostics/diag_htp_ops.py)."""
    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn

    # the same graph, traced without dynamo (~120 s of a SmolLM2 graph's ~300 s), its Python source generated only
    # where it is run (lazy_graph_module_recompile), the signature asked about placeholders only
    with qnn_reexport_non_strict(), lazy_graph_module_recompile(), signature_lookups_for_placeholders_only():
        return to_edge_transform_and_lower_to_qnn(
            module={n: g["module"] for n, g in graphs.items()}, inputs={n: g["inputs"] for n, g in graphs.items()},
            compiler_specs={n: g["spec"] for n, g in graphs.items()}, constant_methods=constant_methods,
            dep_table={n: g["deps"] for n, g in graphs.items()},
            passes_job={n: g["passes"] for n, g in graphs.items()}, skip_node_op_set={"llama.fallback.default"},
            generate_etrecord=generate_etrecord,
        )


def lower_graphs_measured(graphs: dict, constant_methods=None):
    """lower_graphs, keeping what QNN's preparation says of each graph's call in the graph's dict: `ddr`, the bytes
    it reads and writes (its DDR bandwidth summary, qexp/speed/ddr.py), and `sim`, its simulated cycles where the SoC
    has them (sim_cycles.py); None where the graphs' reports cannot be told apart."""
    from qexp.speed import ddr

    with ddr.captured() as text, sim_cycles.collected() as simulated:
        edge = lower_graphs(graphs, constant_methods)
    for key, reports, total in (("ddr", ddr.parse(text[0]), ddr.total), ("sim", simulated, sim_cycles.total)):
        if len(graphs) == 1:
            next(iter(graphs.values()))[key] = total(reports)
        else:  # one shared context: a report per graph, in order, when there is exactly one each
            for graph, report in zip(graphs.values(), reports if len(reports) == len(graphs) else []):
                graph[key] = report
    return edge


def constant_methods_of(graphs: dict) -> dict:
    """The program's constant methods (upstream's metadata and the logits' encoding), from the first graph."""
    first = next(iter(graphs.values()))
    methods = {k: v for k, v in first["meta"].items() if k != "get_ar_len"}
    methods["get_logits_scale"], methods["get_logits_zero_point"] = first["encodings"]["logits"]
    return methods


def build_and_lower(builders: dict, timer: StageTimer, w4_as_lpbq: bool, workers: int = 0):
    """All graphs, each built by its builder (`deploy_graph` bound to a graph), into one HTP-delegated program ->
    (.pte bytes, delegated / non-delegated node counts per graph, the processes that lowered them at once, each
    graph's `meta` and `encodings`).
    workers >= 1: each graph built and lowered on its own into its own QNN context (qexp/backends/htp/parallel.py),
    `workers` of them at once in forked processes (1: one after the other in this process); 0: upstream's single
    call (one QNN context holding every graph)."""
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import EdgeProgramManager

    from qexp.backends.htp.parallel import graph_info, lower_in_turn, lower_in_workers

    w4_encoding = lower_4bit_per_channel_as_lpbq() if w4_as_lpbq else contextlib.nullcontext()
    if workers > 1 and not _room_for_workers(len(builders) - 1):  # compile_workers() keeps workers <= len(graphs)
        workers = 1
    if workers >= 1:
        with timer.stage("lower"), w4_encoding:
            lower = lower_in_workers if workers > 1 else lower_in_turn
            programs, graphs = lower(builders, lower_graphs_measured)
            edge = EdgeProgramManager(programs, constant_methods_of(graphs), compile_config=qnn_edge_config())
        for name, graph in graphs.items():  # a graph built in a worker: its build time, as if built here
            timer.durations.setdefault(f"quantize_{name}", graph["quantize_s"])
    else:
        from qexp.backends.htp.progress import lowering_bars

        graphs = {name: build() for name, build in builders.items()}
        together = " + ".join(graphs)  # one call lowers every graph into one QNN context
        with timer.stage("lower"), w4_encoding, lowering_bars({together: "this process"}) as done:
            edge = lower_graphs_measured(graphs, constant_methods_of(graphs))
            done(together)
        graphs = {name: graph_info(graph) for name, graph in graphs.items()}
    # what the lowering freed (ExecuTorch's intermediate programs) back to the OS before the program is emitted and
    # the emulator loads it (qexp/timing.release_memory)
    release_memory()
    delegation = {}
    for name in graphs:
        info = get_delegation_info(edge.exported_program(name).graph_module)
        delegation[name] = {"delegated": info.num_delegated_nodes, "non_delegated": info.num_non_delegated_nodes,
                            "qnn_contexts": info.num_delegated_subgraphs}
    with timer.stage("to_executorch"):
        program = edge.to_executorch(executorch_backend_config())
    return program.buffer, delegation, workers, graphs
