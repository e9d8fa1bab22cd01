"""QDQ evaluation throughput: the converted program as convert_pt2e leaves it (every weight dequantized on every
forward) against the copy the QDQ stage evaluates (weights dequantized once, each activation's quantize/dequantize
pair one fake_quantize op: qexp/quant/fold.py) and against the copy with only the weights folded, side by side on the
same windows in one process, alternating, with the FP static llama for reference. Also checks the programs'
logits are bit-identical. Prints seconds per window and the ratios, and logs them to the MLflow experiment
`benchmarks`. Run it on an otherwise idle machine: with another job on the same cores, PyTorch's OpenMP threads
wait for each other and small ops slow down by 10x or more.

    .venv/bin/python benchmarks/bench_qdq_eval.py                                  # SmolLM2-135M, 16a4w
    .venv/bin/python benchmarks/bench_qdq_eval.py model=gemma3_270m quant=16a8w    # any qexp overrides
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402
from qexp.tracking.store import embedded_store_uri  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2, help="windows timed per program and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from qexp.models.static_llama import window_logits
    from qexp.pipeline import prepare
    from qexp.quant.fold import with_weights_dequantized

    overrides = args.overrides or ["quant=16a4w"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "backend=none", f"eval.limit={args.windows}"])
    state = prepare(cfg, "qdq")
    program, static = state.qdq.program.module, state.qdq.static
    folded = with_weights_dequantized(program)
    weights_only = with_weights_dequantized(program, fuse_activations=False)
    windows = state.windows.ids.tolist()
    reference = [window_logits(program, static, w) for w in windows[:1]]
    same = all(torch.equal(r, window_logits(m, static, w)) for m in (folded, weights_only)
               for r, w in zip(reference, windows[:1]))

    def per_window(module) -> float:
        start = time.perf_counter()
        for ids in windows:
            window_logits(module, static, ids)
        return (time.perf_counter() - start) / len(windows)

    times = {"fp": [], "program": [], "weights_only": [], "folded": []}
    for _ in range(args.rounds):
        for label, module in (("fp", state.fp_static.module), ("program", program), ("weights_only", weights_only),
                              ("folded", folded)):
            times[label].append(per_window(module))
    median = {label: statistics.median(values) for label, values in times.items()}
    figures = {
        "fp_s_per_window": median["fp"], "qdq_program_s_per_window": median["program"],
        "qdq_weights_folded_s_per_window": median["weights_only"],
        "qdq_folded_s_per_window": median["folded"], "speedup_folded_vs_program": median["program"] / median["folded"],
        "speedup_weights_folded_vs_program": median["program"] / median["weights_only"],
        "qdq_folded_vs_fp": median["folded"] / median["fp"], "logits_bit_identical": float(same),
    }
    for key, value in figures.items():
        print(f"{key:28s} {value:.3f}")
    with benchmark_run(args.store, "qdq-eval", "qdq_eval", {"overrides": " ".join(overrides),
                                                            "numerics.cpu_capability": os.environ.get(
                                                                "ATEN_CPU_CAPABILITY", "")}):
        import mlflow

        mlflow.log_metrics(figures)


if __name__ == "__main__":
    main()
