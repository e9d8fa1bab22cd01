"""QDQ evaluation throughput: the converted program as convert_pt2e leaves it (every weight dequantized on every
forward) against the copy the QDQ stage evaluates (weights dequantized once, each activation's quantize/dequantize
pair one fake_quantize op, less those that repeat their input's grid: qexp/quant/fold.py), against that copy keeping
every pair, and against the copy with only the weights folded, side by side on the
same windows in one process, alternating, with the FP static llama for reference. Also checks the programs'
logits are bit-identical. Against the CPU's compute limit: the model's FLOPs per token (2 x the matmul weights, the
lm head included and the embedding lookup not, plus the attention's 4 x layers x context x heads x head_dim, which
the static llama computes over the whole context) times tokens/s, against the best GFLOP/s torch.mm reaches here on
the model's own matmul shapes and on a 1024^3 one, with the same threads and kernels. Prints seconds per window and
the ratios, and logs them to the MLflow experiment
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
from qexp.tracking.address import embedded_store_uri  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2, help="windows timed per program and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir


    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

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
    every_pair = with_weights_dequantized(program, drop_redundant=False)
    windows = state.windows.ids.tolist()
    reference = [window_logits(program, static, w) for w in windows[:1]]
    same = all(torch.equal(r, window_logits(m, static, w)) for m in (folded, every_pair, weights_only)
               for r, w in zip(reference, windows[:1]))

    def per_window(module) -> float:
        start = time.perf_counter()
        for ids in windows:
            window_logits(module, static, ids)
        return (time.perf_counter() - start) / len(windows)

    times = {"fp": [], "program": [], "weights_only": [], "every_pair": [], "folded": []}
    for _ in range(args.rounds):
        for label, module in (("fp", state.fp_static.module), ("program", program), ("weights_only", weights_only),
                              ("every_pair", every_pair), ("folded", folded)):
            times[label].append(per_window(module))
    median = {label: statistics.median(values) for label, values in times.items()}
    flops = flops_per_token(state.model, cfg.export.max_context_len)
    tokens = len(windows[0])
    peak = matmul_peak_gflops(tokens, state.model)
    figures = {
        "fp_s_per_window": median["fp"], "qdq_program_s_per_window": median["program"],
        "qdq_weights_folded_s_per_window": median["weights_only"],
        "qdq_folded_s_per_window": median["folded"], "speedup_folded_vs_program": median["program"] / median["folded"],
        "speedup_weights_folded_vs_program": median["program"] / median["weights_only"],
        "qdq_every_pair_s_per_window": median["every_pair"],
        "speedup_folded_vs_every_pair": median["every_pair"] / median["folded"],
        "fake_quant_every_pair": float(count_fake_quant(every_pair)),
        "fake_quant_folded": float(count_fake_quant(folded)),
        "qdq_folded_vs_fp": median["folded"] / median["fp"], "logits_bit_identical": float(same),
        "mflop_per_token": flops / 1e6, "matmul_peak_gflops": peak,
    }
    for label in ("fp", "program", "folded"):
        tok_s = tokens / median[label]
        figures[f"{label}_tok_s"] = tok_s
        figures[f"{label}_fraction_of_matmul_peak"] = flops * tok_s / 1e9 / peak
    for key, value in figures.items():
        print(f"{key:32s} {value:.3f}")
    with benchmark_run(args.store, "qdq-eval", "qdq_eval", {"overrides": " ".join(overrides),
                                                            "numerics.cpu_capability": os.environ.get(
                                                                "ATEN_CPU_CAPABILITY", "")}):
        import mlflow

        mlflow.log_metrics(figures)


def count_fake_quant(module) -> int:
    from qexp.quant.fold import fake_quantize

    return sum(node.target is fake_quantize for node in module.graph.nodes)


def flops_per_token(model, context_len: int) -> float:
    """Multiply-adds x 2 per evaluated token: every 2-D weight of the decoder layers and the lm head (a tied lm head
    is the embedding matrix), plus q.k and p.v over the whole static context."""
    sd, p = model.state_dict, model.params
    matmul = sum(v.numel() for k, v in sd.items() if k.startswith("layers.") and v.dim() == 2)
    matmul += sd["output.weight"].numel() if "output.weight" in sd else sd["tok_embeddings.weight"].numel()
    head_dim = p.get("head_dim") or p["dim"] // p["n_heads"]
    return 2 * matmul + 4 * p["n_layers"] * context_len * p["n_heads"] * head_dim


def matmul_peak_gflops(tokens: int, model) -> float:
    """The best float32 torch.mm throughput over the model's matmul shapes (tokens x in @ in x out) and 1024^3."""
    shapes = {(tokens, v.shape[1], v.shape[0]) for k, v in model.state_dict.items()
              if k.startswith("layers.") and v.dim() == 2} | {(1024, 1024, 1024)}
    best = 0.0
    for m, k, n in sorted(shapes):
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(3):
            torch.mm(a, b)
        reps = max(3, int(2e10 / (2 * m * k * n)))
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return best


if __name__ == "__main__":
    main()
