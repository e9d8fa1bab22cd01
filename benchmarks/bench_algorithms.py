"""What each quantization algorithm costs on its own: rotation, AWQ and GPTQ applied to the loaded model, one after
the other in one process, on the same calibration data, each computed (a throwaway cache, so never a cache hit).
Prints seconds per algorithm against the project's targets on SmolLM2-135M and this 2-core machine (rotations < 30 s,
AWQ < 3 min, GPTQ < 3 min) and logs them to the MLflow experiment `benchmarks`. SeqMSE is not here: it searches
during calibration, so its cost is in the quantize stage of a run with algorithm=[seq_mse].
Run it on an otherwise idle machine; times with another job on the same cores are upper bounds.

    .venv/bin/python benchmarks/bench_algorithms.py                                     # 16a4w_block, block 32
    .venv/bin/python benchmarks/bench_algorithms.py quant=16a4w calibration.limit=16    # any qexp overrides
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402
from qexp.tracking.address import embedded_store_uri  # noqa: E402

TARGET_S = {"rotation": 30.0, "awq": 180.0, "gptq": 180.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default="rotation,awq,gptq")
    parser.add_argument("--store", default=os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri())
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir


    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    from qexp.cache import Cache
    from qexp.pipeline import prepare
    from qexp.core.timing import StageTimer
    from qexp.transforms import TransformContext, apply_transforms, build_transforms

    overrides = args.overrides or ["quant=16a4w_block", "quant.block_size=32", "calibration.sampling=spread"]
    names = args.algorithms.split(",")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfgs = {name: compose("config", overrides=[*overrides, "backend=none", f"algorithm=[{name}]"])
                for name in names}
    state = prepare(cfgs[names[0]], "calibration")  # the model and calibration data, shared by every algorithm
    figures = {}
    with tempfile.TemporaryDirectory(prefix="qexp-bench-algorithms-") as tmp:
        for name in names:
            context = TransformContext(cfgs[name], state.calibration, Cache(tmp), StageTimer())
            start = time.perf_counter()
            apply_transforms(state.model, build_transforms(cfgs[name].algorithm), context)
            seconds = time.perf_counter() - start
            assert not any(context.cache_hits.values()), "a throwaway cache cannot hit"
            figures[f"{name}_s"] = seconds
            figures[f"{name}_vs_target"] = seconds / TARGET_S[name] if name in TARGET_S else float("nan")
            target = (f" (target {TARGET_S[name]:.0f} s: {seconds / TARGET_S[name]:.2f} of it)"
                      if name in TARGET_S else "")
            print(f"[bench] {name}: {seconds:.1f} s{target}", flush=True)
    with benchmark_run(args.store, "algorithms", "algorithms", {"overrides": " ".join(overrides),
                                                                "model": state.cfg.model.name,
                                                                "calibration_tokens": str(state.calibration.n_tokens)
                                                                if hasattr(state.calibration, "n_tokens") else ""}):
        import mlflow

        mlflow.log_metrics(figures)


if __name__ == "__main__":
    main()
