"""Where a run's torch work runs: the top-level `device` setting (auto | cpu | cuda).

On the chosen device run the FP phase, the transformed model's float evaluation, the QDQ phase's evaluation, the
tasks' FP and QDQ scorers and QAT (which follows `device` unless `algorithm.qat.device` says otherwise). The export,
QnnQuantizer's calibration, the other algorithms, the lowering and QNN's compile, the HTP emulator and XNNPACK stay
on the CPU (x86 libraries, or work not yet moved); docs/gpu.md keeps that list.

CUDA's kernels round differently from the CPU's, so a result computed on CUDA is cached apart from a CPU one
(`device_key`) and its run carries the device in its tags; the CPU's key part is empty, which keeps every cache key
computed before this setting existed valid.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict

import torch

from qexp.errors import ConfigError

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

    for sub in module.modules():
        for table in (sub._parameters, sub._buffers, vars(sub)):
            for name, value in list(table.items()):
                if isinstance(value, torch.Tensor) and value.device != device:
                    saved.append((table, name, value))
                    table[name] = copy_of(value)
    return saved


def on_device(device: torch.device, module: torch.nn.Module, work):
    """work(module) with `module` placed on `device` (see `placed`); its CPU tensors are back afterwards."""
    with placed(module, device):
        return work(module)
