"""Provenance: what a result depends on. Library versions, the environment a run ran in, the hash of a run's config
and the keys of the content-addressed cache entries the stages share (a key changes exactly when its content would).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Dict

from omegaconf import DictConfig, OmegaConf

from qexp.core.hashing import stable_hash

log = logging.getLogger("qexp")

REPO_ROOT = Path(__file__).resolve().parents[2]  # qexp/core/provenance.py -> the repository
# Bump when a change makes cached QDQ programs of the same inputs differ.
QDQ_CACHE_VERSION = 3


# Settings added after runs and cache entries existed: at their default value they are left out of config hashes
# and cache keys, so earlier runs still match (a sweep skips them) and earlier cache entries stay valid.
LATER_DEFAULTS = {("quant", "weight_range"): "narrow", ("eval", "htp_exact"): False,
                  ("backend", "compile_workers"): 2, ("backend", "contexts"): "per_graph",
                  ("model", "masked_softmax"): None, ("algorithm", "weight_clip", "objective"): "weights",
                  ("sensitivity",): None, ("search",): None, ("eval", "tasks"): [], ("eval", "task_paths"): [],
                  ("eval", "task_limit"): None,
                  ("sensitivity", "low_weights"): "rtn", ("algorithm", "qat", "scale_lr"): None,
                  ("model", "tiny", "config"): None}


def without_later_defaults(container: dict, prefix: tuple = ()) -> dict:
    """A copy of `container` (the config subtree at `prefix`) without the LATER_DEFAULTS settings at their default."""
    import copy

    out = copy.deepcopy(container)
    for path, default in LATER_DEFAULTS.items():
        if path[: len(prefix)] != prefix:
            continue
        node = out
        for part in path[len(prefix):-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node and node[path[-1]] == default:
            del node[path[-1]]
    return out


def config_hash(cfg: DictConfig) -> str:
    """Hash of everything that determines a run's results (not where it is tracked or cached)."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for volatile in ("tracking", "cache_dir", "cache", "verbose"):
        container.pop(volatile, None)
    # where the torch phases run, resolved (auto is CUDA on one host and the CPU on another); the CPU's is left
    # out, which keeps the hashes of every run from before the setting
    container.pop("device", None)
    container.update(_resolved_device(cfg))
    return stable_hash(without_later_defaults(container), length=16)


def _resolved_device(cfg: DictConfig) -> Dict[str, str]:
    from qexp.core.device import resolved_name

    # unchecked: an unknown device, or cuda without one, is refused by validate(), inside the run this hash names
    name = resolved_name(cfg.get("device", "cpu"))
    return {} if name == "cpu" else {"device": name}


@functools.lru_cache(maxsize=1)
def library_versions() -> Dict[str, str]:
    """Versions that change results (part of cache keys and run tags)."""

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "absent"

    qnn = version("onnxruntime-qnn")
    return {
        "version.torch": version("torch"),
        "version.executorch": version("executorch"),
        "version.torchao": version("torchao"),
        "version.transformers": version("transformers"),
        "version.lm_eval": version("lm_eval"),
        "version.qnn_libs": f"onnxruntime-qnn {qnn}" if qnn != "absent" else "absent",
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment_tags() -> Dict[str, str]:
    """Where a run ran: the git commit (with -dirty), library versions, host, CPU, Python."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip() or "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", ""
    return {
        "git_commit": commit + ("-dirty" if dirty else ""),
        **library_versions(),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
    }


def pin_cpu_numerics() -> Dict[str, str]:
    """Put PyTorch's CPU numerics in one state for the whole run, whatever ran before, and say which (run tags).

    MKLDNN: QnnQuantizer's constructor turns PyTorch's MKLDNN backend off on AMD hosts (a global flag, against a crash
    there). A run that calibrated therefore evaluated its QDQ program without MKLDNN, and a run that found the program
    in the cache evaluated it with MKLDNN: SmolLM2 16a4w gave ppl 47.291 cold and 47.252 warm on the same AMD host,
    and Intel hosts never turn it off. qexp turns it off on every host before the first stage.

    Kernels: the instruction set PyTorch dispatches to is pinned at import (qexp/__init__.py: AVX2); if PyTorch ran
    before qexp was imported it may be another one, which the tags and the cache keys then say.
    """
    import torch

    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != PINNED_CPU_CAPABILITY and os.environ.get("ATEN_CPU_CAPABILITY", "").upper() != capability:
        log.warning("PyTorch runs %s CPU kernels, not %s: PyTorch ran before qexp was imported (import qexp first), "
                    "so QDQ perplexities may differ from other runs' by ~1%%", capability, PINNED_CPU_CAPABILITY)
    return {"numerics.mkldnn": "off", "numerics.torch_threads": str(torch.get_num_threads()),
            "numerics.cpu_capability": capability, "numerics.mkl_cbwr": os.environ.get("MKL_CBWR", "-")}


PINNED_CPU_CAPABILITY = "AVX2"  # qexp/__init__.py sets ATEN_CPU_CAPABILITY=avx2 unless the user set it
PINNED_MKL_CBWR = "AVX2,STRICT"  # and MKL_CBWR


def numerics_key() -> str:
    """Part of the keys of cached results computed on the CPU: the numerics they were computed with. The CPU model is
    part of it: with the same pinned kernels (AVX2, MKL_CBWR) an Intel Xeon and an AMD EPYC host calibrated SmolLM2's
    default experiment to different programs (QDQ 47.165 vs 46.994, HTP 39.13 vs 39.66), so a cache shared between
    hosts must not hand one host's result to another. So is MKL's code branch where the user chose another one: on an
    Intel Xeon host MKL_CBWR=AVX2, COMPATIBLE and AUTO give three different sgemm results (docs/reproducibility.md);
    the pinned branch adds nothing, which keeps earlier keys valid."""
    import torch

    cbwr = os.environ.get("MKL_CBWR", "")
    branch = "" if cbwr == PINNED_MKL_CBWR else f"-mkl_cbwr={cbwr or 'unset'}"
    return f"mkldnn-off-{torch.backends.cpu.get_cpu_capability()}-{cpu_model()}{branch}"


def fp_eval_key(cfg: DictConfig, model, static, windows, keep_logits: int) -> str:
    """The FP phase of one model on one set of windows (shared by every run and sweep job that asks for it)."""
    extra = {"masked_softmax": True} if static.masked_softmax else {}  # keeps earlier keys valid
    return stable_hash({**extra, "model": model.fingerprint, "arch": cfg.model.arch, "r3": static.r3,
                        "context": cfg.export.max_context_len, "windows": windows.sha256,
                        "keep_logits": keep_logits, "numerics": numerics_key(), "versions": library_versions(),
                        **_device_key(cfg)}, length=24)


def _device_key(cfg: DictConfig) -> Dict[str, str]:
    """Where a cached evaluation ran: nothing for the CPU (earlier keys stay valid), the GPU for CUDA."""
    from qexp.core.device import device_key, run_device

    return device_key(run_device(cfg))


def fp_task_key(cfg: DictConfig, model, static, suite_key: str) -> str:
    """The FP phase of one model on one task suite (its items' hashes and limit)."""
    extra = {"masked_softmax": True} if static.masked_softmax else {}
    return stable_hash({**extra, "model": model.fingerprint, "arch": cfg.model.arch, "r3": static.r3,
                        "context": cfg.export.max_context_len, "tasks": suite_key, "numerics": numerics_key(),
                        "versions": library_versions(), **_device_key(cfg)}, length=24)


def qdq_cache_key(cfg: DictConfig, model, static, calibration, soc: str, algorithms=(), device=None) -> str:
    """Everything that determines a calibrated QDQ program (the model's fingerprint includes its transforms;
    `algorithms`: fingerprints of the calibration-time ones, e.g. SeqMSE; `device`: where it calibrates, a part only
    for CUDA)."""
    from qexp.core.device import device_key

    extra = {"calibration_algorithms": list(algorithms)} if algorithms else {}  # keeps earlier keys valid
    extra.update(device_key(device) if device is not None else {})
    if static.masked_softmax:
        extra["masked_softmax"] = True
    return stable_hash({
        **extra,
        "version": QDQ_CACHE_VERSION,
        "model": model.fingerprint,
        "arch": cfg.model.arch,
        "r3": static.r3,
        "recompose_hadamard": cfg.model.recompose_hadamard,
        "context": cfg.export.max_context_len,
        "quant": without_later_defaults(OmegaConf.to_container(cfg.quant, resolve=True, enum_to_str=True), ("quant",)),
        "observer": OmegaConf.to_container(cfg.observer, resolve=True, enum_to_str=True),
        "calibration": calibration.sha256,
        "soc": soc,
        "numerics": numerics_key(),  # calibration runs the model eagerly (on the CPU unless `device` says)
        "versions": library_versions(),
    }, length=24)
