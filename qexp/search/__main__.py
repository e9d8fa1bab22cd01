"""`python -m qexp.search -m [model=...] [quant=LOW] [sensitivity.high=HIGH] ...`: a mixed-precision search.

Without -m it measures one point (`search.promote.down=3 search.promote.lm_head=1 ...`) as one run.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
from qexp.core.errors import one_line
from qexp.core.redact import mask_log_records

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
mask_log_records()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="search")
def main(cfg: DictConfig):
    from qexp.search.run import run_trial
    from qexp.tracking.sweep import current_job

    job = current_job(cfg.tracking.sweep)
    try:
        run_id, result = run_trial(cfg, job)
    except KeyboardInterrupt:
        print("qexp: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - one line; details in the MLflow run
        message, status = one_line(exc)
        if job is not None:  # the sweeper marks the trial failed; the sweep's summary reports it
            job.record("failed", getattr(exc, "run_id", None), None, str(exc)[:2000])
            print(f"{message} [trial {job.num}]", file=sys.stderr)
            return None
        print(message, file=sys.stderr)
        sys.exit(status)
    s = result.speed
    label = f"trial {job.num}" if job is not None else "search point"
    print(f"qexp: {label}: {result.bits:.3f} bits (lm head {result.lm_head_bits:g}), {result.ppl_ratio:+.2%} "
          f"[{result.ci_low:+.1%}, {result.ci_high:+.1%}] vs FP on the selection windows, decode "
          f"{s.decode_tok_s:.0f} tok/s on {s.soc} (estimate, median error {s.decode_err:.0%}) (run {run_id[:8]})")
    values = [result.objective(name) for name in cfg.search.objectives]
    return values[0] if len(values) == 1 else values


if __name__ == "__main__":
    main()
