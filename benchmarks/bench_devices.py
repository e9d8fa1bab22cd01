"""The same run's torch phases on the CPU and on CUDA, side by side in one process: the stages up to the QDQ phase
(`qexp.pipeline.prepare`) once per device, each in a fresh cache so neither reads the other's results, then the
seconds of each stage, their ratios, the perplexities' differences and the peak memory (host RSS; on CUDA also the
GPU's peak allocation). On a host without a GPU it times the CPU alone and says so. Prints one table; with --out,
writes it and the host (CPU, GPU, driver, torch build) to DIR/bench_devices.md and .json.

What moves with `device` (docs/gpu.md): the FP phase, the algorithms (`transform_*` rows), the transformed model's
float evaluation, the calibration, the QDQ phase's evaluation, the tasks' scorers; the export, prepare and convert
inside `quantize` stay on the CPU. Add eval.tasks=[...] to time the tasks, 'algorithm=[...]' for the stack.

    .venv/bin/python benchmarks/bench_devices.py                                   # SmolLM2-135M, 16a4w, 32 windows
    .venv/bin/python benchmarks/bench_devices.py model=shape_llama3_2_1b eval.limit=8 --out results/gpu
    .venv/bin/python benchmarks/bench_devices.py model=tiny eval.seq_len=64 eval.limit=3 calibration.limit=3
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STAGES = ("load", "calibration_data", "eval_fp", "transform_*", "eval_fp_transformed", "quantize", "calibrate",
          "eval_qdq", "tasks_fp", "tasks_qdq")  # in a run's order; transform_* stands for each algorithm's stage


def stages_of(results: list) -> list:
    """The stages timed on any device, in STAGES' order (each algorithm's transform_<name> in the run's order)."""
    timed = [s for r in results for s in r["seconds"]]
    ordered = []
    for stage in STAGES:
        names = [s for s in timed if s.startswith("transform_")] if stage == "transform_*" else [stage]
        ordered += [s for s in names if s in timed and s not in ordered]
    return ordered


def run_on(device: str, overrides: list) -> dict:
    import qexp  # noqa: F401 - pins the CPU kernels before any torch work
    from qexp.compose import compose
    from qexp.pipeline import prepare

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix=f"qexp-bench-{device}-") as cache:
        start = time.perf_counter()
        state = prepare(compose([*overrides, f"device={device}", f"cache_dir={cache}"]), "tasks")
        wall = time.perf_counter() - start
    seconds = {k[len("time_"):-2]: v for k, v in state.timer.metrics().items() if k.startswith("time_")}
    return {
        "device": device, "wall_s": round(wall, 2), "seconds": seconds,
        "ppl_fp": state.metrics.get("ppl_fp"), "ppl_qdq": state.metrics.get("ppl_qdq"),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        "tags": {k: v for k, v in state.tags.items() if k.startswith(("device", "cuda"))},
    }


def host() -> dict:
    from qexp.core.provenance import cpu_model, environment_tags

    info = {"cpu": cpu_model(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "python": platform.python_version(), "git_commit": environment_tags()["git_commit"]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    driver=torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else "?")
    return info


def table(results: list) -> str:
    head = "| stage | " + " | ".join(f"{r['device']} s" for r in results) + (
        " | CPU / CUDA |" if len(results) > 1 else " |")
    lines = [head, "|---" * (len(results) + 1 + (len(results) > 1)) + "|"]
    for stage in (*stages_of(results), "total"):
        values = [r["seconds"].get(stage) for r in results]
        if all(v is None for v in values):
            continue
        row = f"| {stage} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values)
        if len(results) > 1 and values[0] and values[1]:
            row += f" | {values[0] / values[1]:.1f}x"
        elif len(results) > 1:
            row += " | "
        lines.append(row + " |")
    for metric in ("ppl_fp", "ppl_qdq"):
        ppl = [r[metric] for r in results]
        if ppl[0] is not None:
            diff = f" (CUDA {ppl[1] / ppl[0] - 1:+.2e} from the CPU)" if len(ppl) > 1 and ppl[1] else ""
            lines.append(f"\n{metric}: " + ", ".join(f"{r['device']} {p:.6f}" for r, p in zip(results, ppl)) + diff)
    lines.append("\npeak host RSS of the process after each device (GiB): " + ", ".join(
        f"{r['device']} {r['peak_rss_gib']}" for r in results))
    if len(results) > 1:
        lines.append(f"GPU peak allocation (GiB): {results[1]['gpu_peak_gib']}")
    else:
        lines.append(f"no CUDA device here (torch {torch.__version__}): the CPU alone was timed")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for bench_devices.md and .json")
    parser.add_argument("overrides", nargs="*", default=["eval.limit=32"])
    args = parser.parse_args()
    overrides = ["backend=none", *args.overrides]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = [run_on(device, overrides) for device in devices]
    text = f"python benchmarks/bench_devices.py {' '.join(args.overrides)}\n\n{table(results)}\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_devices.md").write_text(text)
        (args.out / "bench_devices.json").write_text(json.dumps({"host": host(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
