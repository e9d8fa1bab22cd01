"""HTP lowering of one deploy graph (SmolLM2's kv graph by default), with qexp's lowering patches all on and with one
of them off, side by side in one process on the same calibrated model: the seconds the graph's build (export,
prepare, convert, QNN's annotation) and its lowering take, the ratio, and whether both programs delegate the same
nodes. The patches are the context managers of qexp/upstream/private.py that qexp/backends/htp/lower.py applies
(`--off NAME` picks the one turned off; default the newest, `signature_lookups_for_placeholders_only`). Logs to the
MLflow experiment `benchmarks`. Run it on an otherwise idle machine.

    .venv/bin/python benchmarks/bench_lowering.py                                   # SmolLM2-135M, 16a4w, context 64
    .venv/bin/python benchmarks/bench_lowering.py --rounds 2 model=gemma3_270m      # any qexp overrides
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402
from qexp.tracking.address import embedded_store_uri  # noqa: E402

DEFAULT = ["+experiment=16a4w_wikitext", "eval.seq_len=64", "eval.limit=1", "calibration.limit=8"]


def _lower_once(state, off: str | None) -> dict:
    """Build and lower the kv graph in this process (one QNN context), `off` patched to a no-op; its timings."""
    import torch

    import qexp.backends.htp.lower as lower
    from qexp.core.timing import StageTimer

    inputs = state.phase_inputs()
    lower.ensure_qnn_sdk(inputs.cache)  # QNN's libraries where ExecuTorch looks for them, as compile_pte does
    stats = torch.load(inputs.qdq.program.stats_path, weights_only=True)
    timer = StageTimer()
    original = getattr(lower, off) if off else None
    if off:
        setattr(lower, off, contextlib.nullcontext)
    try:
        def build():
            return lower.deploy_graph(inputs.model, state.cfg, lower.KV_GRAPH, 1, inputs.qdq.r3, stats, timer)

        started = time.perf_counter()
        buffer, delegation, _, _ = lower.build_and_lower({lower.KV_GRAPH: build}, timer,
                                                         state.cfg.backend.w4_lowering.value == "lpbq", workers=0)
        total = time.perf_counter() - started
    finally:
        if off:
            setattr(lower, off, original)
    return {"total_s": total, "lower_s": timer.durations.get("lower", float("nan")), "pte_bytes": len(buffer),
            "delegation": delegation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--off", default="signature_lookups_for_placeholders_only",
                        help="the lowering patch turned off on the other side")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas
    from qexp.pipeline import prepare

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*DEFAULT, *args.overrides, "backend=htp", "backend.model_mode=kv"])
    state = prepare(cfg, "qdq")
    sides = {"all patches": None, f"without {args.off}": args.off}
    runs: dict = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name, off in (sides.items() if round_ % 2 == 0 else reversed(sides.items())):
            runs[name].append(_lower_once(state, off))
            print(f"round {round_ + 1}, {name}: {runs[name][-1]['total_s']:.1f} s "
                  f"(lower {runs[name][-1]['lower_s']:.1f} s)", flush=True)
    best = {name: min(r["total_s"] for r in results) for name, results in runs.items()}
    on, off = best["all patches"], best[f"without {args.off}"]
    same = all(r["delegation"] == runs["all patches"][0]["delegation"] for results in runs.values() for r in results)
    print(f"kv graph build + lowering, best of {args.rounds}: {on:.1f} s with all patches, {off:.1f} s without "
          f"{args.off}: x{off / on:.2f}; same delegation: {same}")
    tags = {"off": args.off, "overrides": " ".join(args.overrides)}
    with benchmark_run(args.store, "bench_lowering", "lowering", tags):
        import mlflow

        mlflow.log_metrics({"lowering_all_patches_s": on, "lowering_one_off_s": off, "speedup": off / on,
                            "same_delegation": float(same)})
    if not same:
        sys.exit("the two programs delegate different nodes")


if __name__ == "__main__":
    main()
