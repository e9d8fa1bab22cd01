"""Lowering a multi-graph program one graph at a time, each into its own QNN context: in worker processes at once
(lower_in_workers, backend.compile_workers=2) or one after the other in this process (lower_in_turn, 1).

Profiled on SmolLM2 (hybrid, two graphs, 419 s of lowering): 85% of it is ExecuTorch's and torch's Python graph work
per method (export, decompositions, edge passes, partitioning, op wrappers) and QNN's own graph preparation is ~5%;
all of it runs on one core, one method after the other. The methods are independent until the program is
assembled, so with `backend.compile_workers=2` each graph but the first is built and lowered in a forked child
process (lower.deploy_graph, then `to_edge_transform_and_lower_to_qnn` on that graph alone, with the same passes and
compiler spec) while the parent builds and lowers the first. The child builds its graph after the fork: the builds
(~21 s each on SmolLM2) run at once too, and the parent never holds a graph it does not lower. The child sends its
lowered edge program back through ExecuTorch's own serializer (`executorch.exir.serde`, what ETRecord uses for
delegated programs); the parent assembles the methods in their usual order into one EdgeProgramManager and emits
the .pte.

What changes against upstream's single lowering call (`backend.contexts=shared`): each graph has its own QNN
context binary (the single call puts all graphs' op wrappers into one shared context). The graphs are compiled from
the same edge programs with the same specs, so they compute the same: tests/test_htp.py requires bit-identical
emulator outputs against the one-process lowering. QNN's context binaries are not byte-reproducible even between
two identical compiles, so bytes are not the check. The cache key of the .pte records the layout (`contexts`), not
how many processes made it: compile_workers 1 and 2 give the same program and share a cache entry.

A forked child starts with the parent's memory shared copy-on-write; it sets one intra-op thread (torch's OpenMP
pool does not survive a fork) and ends with os._exit, never returning into the parent's code (MLflow, Hydra).
A child that fails or dies ends the compile with one line naming the graph and the reason.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Dict

log = logging.getLogger("qexp")

Builder = Callable[[], dict]  # builds one deploy graph (lower.deploy_graph bound to it), where it is lowered


def lower_in_workers(graphs: Dict[str, Builder], lower_one: Callable[[Dict[str, dict]], object]):
    """({method: lowered edge ExportedProgram}, {method: the graph's GRAPH_INFO}), in the order of `graphs`, whose
    values build each graph (called in the process that lowers it). `lower_one({name: graph})` lowers graphs in
    this process and returns the EdgeProgramManager; the first graph is built and lowered here, the others in
    forked children at the same time."""
    from qexp.backends.htp.progress import labels_for, lowering_bars

    from qexp.core.timing import release_memory

    names = list(graphs)
    release_memory()  # a forked worker starts with the parent's resident pages: hand back what is free first
    infos = {}
    with tempfile.TemporaryDirectory(prefix="qexp-lower-") as tmp:
        pending = {name: _fork(name, graphs[name], lower_one, Path(tmp)) for name in names[1:]}
        log.info("lowering %s here and %s in worker process(es) %s, at the same time", names[0], ", ".join(names[1:]),
                 ", ".join(str(pid) for pid in pending.values()))
        seconds = {}
        try:
            with lowering_bars(labels_for(names, pending),
                               {name: _finish_time(name, Path(tmp)) for name in pending}) as done:
                graph = graphs[names[0]]()
                here = lower_one({names[0]: graph})
                infos[names[0]] = graph_info(graph)  # after lowering: the lowering adds to it (QNN's DDR summary)
                programs = {names[0]: here.exported_program(names[0])}
                seconds[names[0]] = done(names[0])
                del here, graph
                drop_unused_weights(programs[names[0]])  # as the workers' programs arrive: without them
                release_memory()  # before the workers' programs are read back
                for name in names[1:]:
                    _, status = os.waitpid(pending[name], 0)
                    del pending[name]
                    seconds[name] = done(name)
                    programs[name], infos[name] = _collect(name, status, Path(tmp))
            log.info("lowered %s", ", ".join(f"{name} in {seconds[name]:.0f} s" for name in names))
        finally:
            for pid in pending.values():  # the parent failed or was interrupted first: the workers' work is of no use
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
    return {name: programs[name] for name in names}, {name: infos[name] for name in names}


def lower_in_turn(graphs: Dict[str, Builder], lower_one: Callable[[Dict[str, dict]], object]):
    """What lower_in_workers returns, in the same layout (a QNN context per graph), each graph built and lowered
    one after the other in this process, each program without the weights it no longer uses before the next graph
    is built. The lowest peak memory: one graph's lowering (backend.compile_workers=1)."""
    from qexp.backends.htp.progress import lowering_bars
    from qexp.core.timing import release_memory

    programs, infos, seconds = {}, {}, {}
    for name in graphs:
        with lowering_bars({name: "this process"}) as done:
            graph = graphs[name]()
            programs[name] = lower_one({name: graph}).exported_program(name)
            infos[name] = graph_info(graph)
            seconds[name] = done(name)
        del graph
        drop_unused_weights(programs[name])
        release_memory()
    log.info("lowered %s, one after the other", ", ".join(f"{name} in {seconds[name]:.0f} s" for name in graphs))
    return programs, infos


# what a built graph leaves once lowered (small, picklable): what the program's assembly and meta.json need of it
GRAPH_INFO = ("meta", "encodings", "quantize_s", "ddr", "sim")


def graph_info(graph: dict) -> dict:
    """What the program's assembly and meta.json need of a graph once it is lowered (GRAPH_INFO)."""
    return {key: graph[key] for key in GRAPH_INFO if key in graph}


def _finish_time(name: str, tmp: Path):
    """When the worker for `name` wrote its result or error (it leaves right after), or None while it runs."""

    def probe():
        for path in (tmp / f"{name}.pkl", tmp / f"{name}.error"):
            try:
                return path.stat().st_mtime
            except FileNotFoundError:
                continue
        return None

    return probe


def _fork(name: str, build: Builder, lower_one, tmp: Path) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    # ---- the child: lower one graph, write the serialized program (or the error), leave without cleanup handlers
    status = 1
    try:
        _die_with_parent()
        import torch

        torch.set_num_threads(1)
        log_buffer = io.StringIO()
        handler = logging.StreamHandler(log_buffer)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
        logging.getLogger().addHandler(handler)
        graph = build()
        payload = to_payload(lower_one({name: graph}).exported_program(name))
        payload["log"], payload["info"] = log_buffer.getvalue(), graph_info(graph)
        with open(tmp / f"{name}.partial", "wb") as f:
            pickle.dump(payload, f, protocol=5)
        os.replace(tmp / f"{name}.partial", tmp / f"{name}.pkl")
        status = 0
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent as one line
        try:
            (tmp / f"{name}.error").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(status)


def _die_with_parent() -> None:
    """A worker whose parent is killed (SIGKILL, the OOM killer) is killed too, not left lowering for minutes; it
    also holds the run's liveness pipe open, which would keep the watchdog from marking the run KILLED (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _collect(name: str, status: int, tmp: Path):
    result, error = tmp / f"{name}.pkl", tmp / f"{name}.error"
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        why = " (killed: most likely out of memory)" if sig == "SIGKILL" else ""
        raise RuntimeError(f"the compile worker for {name} died with {sig}{why}; backend.compile_workers=1 lowers "
                           "the graphs one after the other in one process")
    if os.WEXITSTATUS(status) != 0 or not result.is_file():
        detail = error.read_text() if error.is_file() else "no error recorded"
        log.debug("compile worker for %s failed:\n%s", name, detail)
        raise RuntimeError(f"the compile worker for {name} failed: {detail.splitlines()[0]}")
    with open(result, "rb") as f:
        payload = pickle.load(f)
    _append_to_run_log(payload.pop("log"))
    info = payload.pop("info")
    return from_payload(payload), info


def to_payload(program) -> dict:
    """A lowered edge program as picklable data for the parent: ExecuTorch's serializer (`executorch.exir.serde`)
    plus the backend's node metadata it does not keep. The weights the lowered program no longer uses are left
    out first (drop_unused_weights)."""
    from executorch.exir.serde.serialize import serialize

    drop_unused_weights(program)
    artifact = serialize(program)
    parts = (artifact.exported_program, artifact.state_dict, artifact.constants, artifact.example_inputs)
    return {"artifact": parts, "meta": _backend_meta(program)}


def from_payload(payload: dict):
    from executorch.exir.serde.export_serialize import SerializedArtifact
    from executorch.exir.serde.serialize import deserialize

    program = deserialize(SerializedArtifact(*payload["artifact"]))
    nodes = {node.name: node for node in program.graph_module.graph.nodes}
    for node_name, meta in payload["meta"].items():
        for key, value in meta.items():
            nodes[node_name].meta.setdefault(key, value)
    return program


def drop_unused_weights(program) -> None:
    """Leave out, in place, the float weights a lowered program carries but no longer uses: measured on SmolLM2's
    kv_forward, the outer program's state_dict still holds every weight of the converted module (622 MiB of fp32
    the graph has no placeholder for: all of them went into the QNN context) and the delegate keeps the whole
    pre-lowering program beside its compiled bytes (its `original_module`, 239 MiB of tensors). ExecuTorch's
    serializer carries both as base64 inside JSON inside the pickle; reading that back in the parent peaked 3.2 GiB
    above where it started, 1.7 GiB without the delegate's copy, and was the default run's memory peak
    (diagnostics/diag_compile_memory.py --parallel). The unused state_dict entries are deleted; the delegate's
    tensors become one-element stand-ins of the same shapes (_placeholder_like), since emitting the .pte reads the
    delegate's compiled bytes and its original graph's nodes (debug handles, output count), never their values.
    The .pte bytes are the same (tests/test_htp.py)."""
    import torch
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    signature = program.graph_signature
    used = {*signature.inputs_to_parameters.values(), *signature.inputs_to_buffers.values()}
    for key in [key for key in program.state_dict if key not in used]:
        del program.state_dict[key]
    for module in program.graph_module.modules():
        if not isinstance(module, LoweredBackendModule):
            continue
        original = module.original_module
        for tensors in (original.state_dict, original.constants):
            for key, value in list(tensors.items()):
                if isinstance(value, torch.Tensor):
                    tensors[key] = _placeholder_like(value)


def _placeholder_like(value):
    """A tensor with `value`'s shape, dtype and device holding one element (a stride-0 view): passes that propagate
    fake tensors through the delegate see the same metadata (meta tensors would fail their device checks), and the
    serializer saves one element."""
    import torch

    stub = value.detach().new_zeros(()).expand(value.shape)
    return torch.nn.Parameter(stub, requires_grad=value.requires_grad) if isinstance(value, torch.nn.Parameter) \
        else stub


# Node metadata ExecuTorch's serializer keeps (or rebuilds) itself; anything else a backend put on the lowered
# program's nodes is carried over by name: QNN's `QCOM_QUANTIZED_IO` (the dtype of each quantized graph input and
# output, which BuildQuantIo turns into the program's uint8/uint16 I/O) is one such key.
_SERIALIZED_META = {"val", "tensor_meta", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn",
                    "from_node", "seq_nr", "original_aten", "custom", "spec", "debug_handle", "delegation_tag"}


def _backend_meta(program) -> dict:
    out = {}
    for node in program.graph_module.graph.nodes:
        extra = {}
        for key, value in node.meta.items():
            if key in _SERIALIZED_META:
                continue
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - not data (e.g. a callable): nothing the emitter reads
                continue
            extra[key] = value
        if extra:
            out[node.name] = extra
    return out


def _append_to_run_log(text: str) -> None:
    """The child's library log lines (QNN's per-node INFO lines) into this run's run.log, as if logged here."""
    from qexp.tracking.runlog import RUN_LOG_HANDLER

    if not text:
        return
    for handler in logging.getLogger().handlers:
        if handler.get_name() == RUN_LOG_HANDLER:
            handler.acquire()
            try:
                handler.stream.write(text)
            finally:
                handler.release()
