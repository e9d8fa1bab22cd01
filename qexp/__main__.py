"""`python -m qexp [+experiment=NAME] [group=value ...] [key=value ...]`: run one experiment (or a Hydra multirun)."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

import qexp.config  # noqa: F401 - registers the structured config schema
from qexp.errors import QexpError


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from qexp.pipeline import run_experiment

    try:
        result = run_experiment(cfg)
    except QexpError as exc:
        # One readable line, no traceback: the error is the user's input or environment.
        print(f"qexp: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("qexp: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - a bug or an upstream failure: short line, details in MLflow
        if os.environ.get("QEXP_TRACEBACK"):
            raise
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"qexp: failed: {type(exc).__name__}: {first_line} (traceback: error.txt of the MLflow run, "
            "or rerun with QEXP_TRACEBACK=1)",
            file=sys.stderr,
        )
        sys.exit(1)
    summary = "  ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()) if k.startswith(("ppl", "word_ppl")))
    print(f"qexp: run {result.run_id} finished: {summary}")
    return result.metrics.get("ppl_qdq", result.metrics.get("ppl_fp"))


if __name__ == "__main__":
    main()
