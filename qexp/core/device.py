"""Where a run's torch work runs: the top-level `device` setting (auto | cpu | cuda).

On the chosen device run the FP phase, the algorithms (rotation, SmoothQuant, AWQ, weight clip, GPTQ, and QAT, which
follows `device` unless `algorithm.qat.device` says otherwise), the transformed model's float evaluation,
QnnQuantizer's calibration (SeqMSE within it), the QDQ phase's evaluation and the tasks' FP and QDQ scorers. The
export, the lowering and QNN's compile, the HTP emulator and XNNPACK stay on the CPU (x86 libraries); docs/gpu.md
keeps that list.

CUDA's kernels round differently from the CPU's, so a result computed on CUDA is cached apart from a CPU one
(`device_key`) and its run carries the device in its tags; the CPU's key part is empty, which keeps every cache key
computed before this setting existed valid.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Optional

import torch

from qexp.core.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def check_device(wanted) -> None:
    """One line before any work: an unknown device, or CUDA on a host (or torch build) without it."""
    if wanted not in DEVICES:
        raise ConfigError(f"device={wanted!r} is not a device qexp runs on",
                          "use device=auto (CUDA when present, else the CPU), cpu or cuda")
    if wanted == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ConfigError(f"device=cuda, and torch sees no CUDA device ({build})",
                          "use device=auto or cpu, or run on a host with an NVIDIA GPU and torch's CUDA build")


def resolved_name(wanted) -> str:
    """`auto` -> "cuda" when torch sees a GPU, else "cpu"; any other value as it is (unchecked)."""
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(wanted)


def resolve(wanted) -> torch.device:
    """The checked device: `auto` -> CUDA when torch sees a GPU, else the CPU."""
    check_device(wanted)
    return torch.device(resolved_name(wanted))


def run_device(cfg) -> torch.device:
    """The device of a run's config (a config without the key, composed before it existed, runs on the CPU)."""
    return resolve(cfg.get("device", "cpu"))


def device_key(device: torch.device) -> Dict[str, str]:
    """The part of a cached result's key that says where it was computed: nothing for the CPU (whose numerics key
    already says which CPU), the GPU model and CUDA version for CUDA."""
    if device.type == "cpu":
        return {}
    if device.type != "cuda":  # the meta device of the placement tests
        return {"device": device.type}
    return {"device": f"cuda:{torch.cuda.get_device_name(device)}:cuda{torch.version.cuda}"}


def device_tags(device: torch.device) -> Dict[str, str]:
    """Run tags: which device computed the run's torch phases."""
    if device.type == "cpu":
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(device)
    return {"device": "cuda", "device_name": props.name, "device_memory_gib": f"{props.total_memory / 2**30:.1f}",
            "cuda_version": str(torch.version.cuda)}


@contextmanager
def placed(module: torch.nn.Module, device: torch.device):
    """`module` with its parameters, buffers and plain tensor attributes (an exported program's constants) on
    `device` for the duration; at exit the very CPU tensors it had are put back (no second CPU copy, as a round trip
    with `module.to` would leave while a LoadedModel still holds the first). Tied tensors stay tied."""
    if device.type == "cpu":
        yield module
        return
    saved = move(module, device)
    try:
        yield module
    finally:
        for table, name, value in saved:
            table[name] = value
        if device.type == "cuda":
            torch.cuda.empty_cache()


def move(module: torch.nn.Module, device: torch.device) -> list:
    """Put `module`'s tensors on `device` by swapping each for a device copy (the CPU tensors themselves are not
    touched: a LoadedModel sharing them keeps them). Returns what `placed` puts back: (table, name, CPU tensor)."""
    moved, saved = {}, []

    def copy_of(tensor):
        if id(tensor) not in moved:
            copy = tensor.detach().to(device)
            moved[id(tensor)] = torch.nn.Parameter(copy, tensor.requires_grad) if isinstance(
                tensor, torch.nn.Parameter) else copy
        return moved[id(tensor)]

    for table, name, value in tensor_slots(module):
        if value.device != device:
            saved.append((table, name, value))
            table[name] = copy_of(value)
    return saved


def tensor_slots(module: torch.nn.Module) -> list:
    """(table, name, tensor) for every tensor `module` holds: parameters, buffers and plain tensor attributes (an
    exported program's constants), in each submodule."""
    return [(table, name, value) for sub in module.modules() for table in (sub._parameters, sub._buffers, vars(sub))
            for name, value in list(table.items()) if isinstance(value, torch.Tensor)]


def to_device(tensors, device: torch.device) -> tuple:
    """A model's flat inputs (static llama `inputs`) on `device`."""
    return tuple(t.to(device) for t in tensors)


def on_device(device: torch.device, module: torch.nn.Module, work):
    """work(module) with `module` placed on `device` (see `placed`); its CPU tensors are back afterwards."""
    with placed(module, device):
        return work(module)


# What a run holds on the GPU at its peak, per float32 weight of the static llama (4 bytes each): one module at a time
# is placed there, plus, in the layer-by-layer algorithms and the sensitivity analysis, the algorithm's own copy of
# the layer it edits and the calibration activations (x2); QAT holds the student, its gradients, Adam's two moments
# and the teacher (x5). Plus CUDA's context and the kernels' workspaces. An estimate from the shapes, not a
# measurement: it refuses a GPU that cannot hold the weights, and says so before the model loads.
BYTES_PER_WEIGHT = 4
HOLDS = {"evaluate": 2, "train": 5}
OVERHEAD_GIB = 2.0


def static_llama_weights(dims: dict) -> int:
    """The static llama's weights from the model's shapes: embedding and lm head (kept apart even when tied), and
    per layer q/k/v/o and the three FFN projections (norms are negligible)."""
    head_dim = dims.get("head_dim") or dims["dim"] // dims["n_heads"]
    attention = dims["dim"] * head_dim * (2 * dims["n_heads"] + 2 * dims["n_kv_heads"])
    return 2 * dims["vocab_size"] * dims["dim"] + dims["n_layers"] * (attention + 3 * dims["dim"] * dims["hidden_dim"])


def gpu_need_gib(dims: dict, trains: bool) -> float:
    """Estimated peak GPU memory of a run of a model of these shapes (see HOLDS)."""
    weights_gib = static_llama_weights(dims) * BYTES_PER_WEIGHT / 2**30
    return weights_gib * HOLDS["train" if trains else "evaluate"] + OVERHEAD_GIB


def check_fits(dims: Optional[dict], trains: bool, total_gib: float, name: str) -> None:
    """One line before the model loads when the GPU (`name`, `total_gib`) is smaller than the run's estimated need;
    nothing when the model's shapes are not known before loading."""
    if not dims or any(dims.get(k) is None for k in ("n_layers", "dim", "hidden_dim", "n_heads", "n_kv_heads",
                                                      "vocab_size")):
        return
    need = gpu_need_gib(dims, trains)
    if need > total_gib:
        what = "QAT training" if trains else "its evaluations and algorithms"
        raise ConfigError(f"device=cuda: {name} has {total_gib:.1f} GiB and this model needs about {need:.1f} GiB "
                          f"for {what} (estimated from its shapes: {static_llama_weights(dims) / 1e9:.2f}B float32 "
                          "weights)", "use a GPU with more memory, device=cpu, or (for QAT) algorithm.qat.device=cpu")

