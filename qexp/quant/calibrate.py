"""Quantize + calibrate stage: QnnQuantizer -> prepare_pt2e -> calibrate -> convert_pt2e, cached.

What is cached is the calibration's result and nothing else: every observer's statistics (a few MB), keyed by
everything that determines them (qexp/core/provenance.py). The QDQ program is rebuilt from them on every run, cold or
warm, by the same steps (export, prepare, load the statistics, convert), as the HTP backend builds its kv / prefill
graphs from them. Caching the converted program instead cost 808 MB per SmolLM2 entry and ~56 s to save and reload,
more than the ~20 s the rebuild takes.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from tqdm import tqdm

from qexp.cache import Cache
from qexp.core.config import ObserverConfig, QuantConfig
from qexp.data.calibration import CalibrationSet
from qexp.core.device import placed, to_device
from qexp.models.static_llama import StaticLlama
from qexp.quant.lpbq import quantize_observer_scales
from qexp.quant.recipe import make_quantizer
from qexp.core.timing import StageTimer
from qexp.upstream.private_quantize import convert_in_chunks, forget_prepared_modules

log = logging.getLogger("qexp")

OBSERVERS = "observers.pt"  # calibrated observer statistics: the cache entry; every graph of the model is built from it
# Non-strict export: 4x faster than strict (dynamo) tracing here, same graph. Graphs that later take these
# encodings (kv / prefill) must be exported the same way.
EXPORT_STRICT = False


@dataclass
class QuantizedModel:
    module: Optional[torch.fx.GraphModule]  # the QDQ program (fake-quantized ops, runs on CPU); None once released
    stats_path: Path  # the cached observer statistics it was built from
    key: str
    cache_hit: bool


def quantize(
    static: StaticLlama, quant: QuantConfig, observer: ObserverConfig, calibration: CalibrationSet,
    cache: Cache, key: str, soc: str, timer: StageTimer | None = None, recompose_hadamard: bool = True,
    algorithms: Sequence = (), device: Optional[torch.device] = None,
) -> QuantizedModel:
    """Export the static llama, prepare it with the recipe's QnnQuantizer for `soc`, calibrate on `device` (running
    the calibration-time `algorithms`, e.g. SeqMSE, after the first sample, as upstream), hand over exact weight
    ranges (`static.weight_ranges`), convert (cached). The export and the convert run on the CPU."""
    timer = timer or StageTimer()
    device = device or torch.device("cpu")
    calibrated = {}

    def build(tmp: Path) -> dict:
        with torch.no_grad():
            prepared = prepare(static, quant, observer, soc, recompose_hadamard, timer)
            with placed(prepared, device):  # the statistics are read before its CPU tensors come back
                with timer.stage("calibrate"):
                    for i, sample in enumerate(tqdm(calibration.samples, desc="calibrate", unit="sample",
                                                    leave=False)):
                        prepared(*to_device(static.inputs(sample), device))
                        if i == 0 and algorithms:
                            # the weights are observed on the first forward: their block scales become the LPBQ ones
                            # now, so a scale search (SeqMSE) judges the scales HTP runs (re-rounding after it is
                            # the identity: it scales a whole weight by one factor, which leaves each block's step)
                            quantize_observer_scales(weight_observers(prepared).values(), quant.block_scale_rounding)
                            for algorithm in algorithms:
                                with timer.stage(f"calibrate_{algorithm.name}"):
                                    algorithm.calibrate(prepared, static, calibration, device)
                set_weight_ranges(prepared, static.weight_ranges)
                # block scales as HTP stores them (LPBQ): in the statistics, so the QDQ program and deploy graphs agree
                n = quantize_observer_scales(weight_observers(prepared).values(), quant.block_scale_rounding)
                if n:
                    log.info("LPBQ block scales (%s rounding) in %d weight observers",
                             quant.block_scale_rounding.value, n)
                stats = on_cpu(observer_statistics(prepared))
            torch.save(stats, tmp / OBSERVERS)
        calibrated.update({} if algorithms else {"graph": prepared})  # an algorithm may change more than observers
        return {"samples": len(calibration.samples), "tokens": calibration.n_tokens}

    path, hit = cache.get_or_build("qdq", key, build)
    log.info("QDQ observer statistics %s (%s)", path, "cache hit" if hit else "calibrated")
    # Converted from the statistics as stored, cold too (one path: the same numbers cold and warm), cold in the graph
    # just calibrated (no second export and prepare: 52 of SmolLM2's 133 s; tests compare the programs bit for bit).
    stats = torch.load(path / OBSERVERS, weights_only=True)
    with torch.no_grad():
        prepared = calibrated.pop("graph", None) or prepare(static, quant, observer, soc, recompose_hadamard, timer)
        load_observer_statistics(prepared, stats)
        unfed = unfed_observers(prepared)
        if unfed:
            log.warning("observers that saw no calibration data (default qparams): %s", ", ".join(unfed))
        with timer.stage("convert"), warnings.catch_warnings():
            # torchao warns once per unfed observer; the real ones are named above. The calibration graph's KV-cache
            # inputs hold zero tokens (its AR length is the whole context), so their observers never see data, and
            # what they would quantize is empty: those are expected (the deploy graphs take the caches' encodings
            # from the cache outputs instead).
            warnings.filterwarnings("ignore", message="must run observer before calling calculate_qparams")
            module = convert_in_chunks(prepared)  # convert_pt2e's program, without its big temporaries
    forget_prepared_modules()
    return QuantizedModel(module, path / OBSERVERS, key, hit)


def unfed_observers(prepared: torch.fx.GraphModule) -> list:
    """Activation observers of `prepared` that never saw data, except those of empty inputs (the calibration graph's
    zero-length KV caches)."""
    names = []
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not node.target.startswith("activation_post_process"):
            continue
        observer = getattr(prepared, node.target)
        min_val = getattr(observer, "min_val", None)
        if not isinstance(min_val, torch.Tensor) or min_val.numel() == 0 or not torch.isinf(min_val).all():
            continue
        source = node.args[0] if node.args else None
        value = getattr(source, "meta", {}).get("val")
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            continue
        names.append(getattr(source, "name", node.target))
    return names


def prepare(static: StaticLlama, quant: QuantConfig, observer: ObserverConfig, soc: str, recompose_hadamard: bool,
            timer: StageTimer) -> torch.fx.GraphModule:
    """The static llama exported and prepared with the recipe's QnnQuantizer for `soc` (observers not yet fed)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    quantizer = make_quantizer(quant, observer, soc, recompose_hadamard)
    with timer.stage("export"):
        graph = torch.export.export(static.module, static.example_inputs(), strict=EXPORT_STRICT).module()
    with timer.stage("prepare"):
        prepared = prepare_pt2e(graph, quantizer)
    forget_prepared_modules()
    return prepared


def weight_observers(prepared: torch.fx.GraphModule) -> Dict[str, torch.nn.Module]:
    """{parameter name (e.g. layers.0.attention.wq_conv.weight): its observer} of a prepared graph."""
    found = {}
    for node in prepared.graph.nodes:
        if node.op == "call_module" and node.target.startswith("activation_post_process") and node.args \
                and getattr(node.args[0], "op", None) == "get_attr":
            found[node.args[0].target] = getattr(prepared, node.target)
    return found


def set_weight_ranges(prepared: torch.fx.GraphModule, ranges: Dict[str, torch.Tensor]) -> None:
    """Give weight observers an exact symmetric range (scale = range / qmax) instead of the weights' own absmax."""
    if not ranges:
        return
    observers = weight_observers(prepared)
    missing = sorted(set(ranges) - set(observers))
    if missing:  # a name mismatch would silently re-observe the weights: the handed-over scales would be lost
        raise RuntimeError(f"no weight observer for {missing[0]} (and {len(missing) - 1} more) in the prepared graph")
    with torch.no_grad():
        for name, value in ranges.items():
            observer = observers[name]
            value = value.reshape(observer.min_val.shape).to(observer.min_val.device, observer.min_val.dtype)
            observer.min_val, observer.max_val = -value.clone(), value.clone()


def observer_statistics(prepared: torch.fx.GraphModule) -> dict:
    """Calibrated state of every observer of a prepared graph, with what it observes.

    Graphs of the same model with another AR length (the kv and prefill graphs of the deploy phase) have the same
    observers; loading these statistics into them before convert_pt2e (`load_observer_statistics`) reproduces this
    calibration without re-running it. Plain tensors and strings only, so it loads with weights_only=True. Besides
    the state dict it keeps the statistics some observers hold as plain attributes (QNN's per-block weight observer
    keeps min_val / max_val / original_dtype outside its state dict, and convert needs them).
    """
    stats = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not node.target.startswith("activation_post_process"):
            continue
        observer = getattr(prepared, node.target)
        source = node.args[0] if node.args else None
        stack = getattr(source, "meta", {}).get("nn_module_stack") if source is not None else None
        state = {k: v.clone() for k, v in observer.state_dict().items()}
        attributes = {k: getattr(observer, k).clone() for k in _ATTRIBUTE_STATISTICS
                      if k not in state and isinstance(getattr(observer, k, None), torch.Tensor)}
        if getattr(observer, "original_dtype", None) is not None:
            attributes["original_dtype"] = str(observer.original_dtype).removeprefix("torch.")
        stats[node.target] = {
            "observes": getattr(source, "name", ""),
            "module": list(stack.values())[-1][0] if stack else "",
            "state": state,
            "attributes": attributes,
        }
    return stats


_ATTRIBUTE_STATISTICS = ("min_val", "max_val")


def on_cpu(stats):
    """`observer_statistics` read on another device, with its tensors on the CPU (what the cache keeps)."""
    if isinstance(stats, dict):
        return {k: on_cpu(v) for k, v in stats.items()}
    return stats.cpu() if isinstance(stats, torch.Tensor) else stats


def load_observer_statistics(prepared: torch.fx.GraphModule, stats: dict) -> None:
    """Put `observer_statistics` of a calibrated graph into the same observers of another prepared graph."""
    for name, entry in stats.items():
        observer = getattr(prepared, name)
        observer.load_state_dict(entry["state"])
        for key, value in entry.get("attributes", {}).items():
            setattr(observer, key, getattr(torch, value) if key == "original_dtype" else value.clone())
        if hasattr(observer, "calibrated"):  # per-block observers skip forward once calibrated
            observer.calibrated = True
