"""Does QNN's compile-time simulation rank HTP programs as qexp's speed model does?

Compiles the tiny model at several widths, AR-N and weight bits for SoC SA8797 (the one SoC this QNN build
simulates), each as `python -m qexp` would (one window scored), and puts each graph's simulated cycles
(`htp_sim_cycles_<graph>`, with QNN's lower and upper estimates) beside what the speed model says of one call of
it: the prefill chunk's compute term (flops / rate) and whole call time, and the decode step's time. Prints the
Spearman rank correlation of each pair. SA8797 has no published figures, so the model's times are given for
SM8750: the ranking, not the time, is compared (a v81 simulation is not a phone's clock).

    .venv/bin/python diagnostics/diag_sim_cycles.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import run_qexp  # noqa: E402

WIDTHS = (128, 256, 512)
AR_LENS = (8, 32)
SCHEMES = ("16a8w", "16a4w")


def configs(quick: bool):
    if quick:
        return [(256, 8, "16a8w"), (256, 32, "16a8w"), (512, 32, "16a8w"), (512, 32, "16a4w")]
    return [(w, ar, s) for w in WIDTHS for ar in AR_LENS for s in SCHEMES]


def overrides(width: int, ar_len: int, scheme: str) -> list:
    return ["model=tiny", f"model.tiny.dim={width}", f"model.tiny.hidden_dim={2 * width}",
            "model.tiny.vocab_size=2048", "eval.seq_len=64", "eval.limit=1", "calibration.limit=3",
            f"quant={scheme}", "backend=htp", "backend.soc=SA8797", "backend.model_mode=hybrid",
            f"backend.prefill_ar_len={ar_len}", "tracking.experiment=diag_sim_cycles"]


def modelled(width: int, ar_len: int, scheme: str) -> dict:
    """The speed model's times of one prefill and one decode call of this config on SM8750 (microseconds)."""
    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp.speed.bytes import Shapes, stream_bytes
    from qexp.speed.data import quant_config
    from qexp.speed.fit import fitted
    from qexp.speed.model import flops

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides(width, ar_len, scheme))
    tiny, context = cfg.model.tiny, int(cfg.backend.max_seq_len)
    shapes = Shapes(tiny.n_layers, tiny.dim, tiny.hidden_dim, tiny.n_heads, tiny.n_kv_heads,
                    tiny.head_dim or tiny.dim // tiny.n_heads, tiny.vocab_size)
    fit = fitted()
    soc = fit.data.soc("SM8750")
    quant = quant_config(scheme)
    prefill = stream_bytes(shapes, quant, context, ar_len)
    decode = stream_bytes(shapes, quant, context, 1)
    return {"prefill_compute_us": 1e6 * flops(shapes, ar_len, context) / (fit.model.prefill_tops * 1e12
                                                                         * soc.relative_compute),
            "prefill_us": 1e6 * fit.model.call_seconds(shapes, prefill, soc, ar_len, context),
            "decode_us": 1e6 * fit.model.call_seconds(shapes, decode, soc, 1, context)}


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 configs instead of 12")
    args = parser.parse_args()
    import mlflow

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlruns.db"
        for width, ar_len, scheme in configs(args.quick):
            run_qexp(f"w{width} AR-{ar_len} {scheme}", overrides(width, ar_len, scheme), store)
            mlflow.set_tracking_uri(store)
            run = mlflow.search_runs(experiment_names=["diag_sim_cycles"], order_by=["start_time DESC"],
                                     max_results=1).iloc[0]
            m = {k.removeprefix("metrics."): v for k, v in run.items() if k.startswith("metrics.")}
            rows.append({"config": f"w{width} AR-{ar_len} {scheme}", **modelled(width, ar_len, scheme),
                         **{k: m.get(f"htp_sim_{k}") for k in (
                             "cycles_prefill_forward", "cycles_lower_prefill_forward", "cycles_upper_prefill_forward",
                             "cycles_kv_forward", "missing_ops_prefill_forward")}})
    import pandas as pd

    table = pd.DataFrame(rows).set_index("config")
    print(table.to_string(float_format=lambda v: f"{v:,.1f}"))
    pairs = (("prefill_compute_us", "cycles_prefill_forward"), ("prefill_us", "cycles_prefill_forward"),
             ("decode_us", "cycles_kv_forward"))
    for model_col, sim_col in pairs:
        print(f"Spearman({model_col}, simulated {sim_col}) = {spearman(table[model_col], table[sim_col]):+.2f}")
    ratio = table["cycles_prefill_forward"] / table["prefill_compute_us"]
    print(f"simulated prefill cycles per modelled compute-us: {ratio.min():,.0f} .. {ratio.max():,.0f} "
          f"(a constant would mean the compute term's ranking and scale agree)")
    if np.any(table["missing_ops_prefill_forward"] > 0):
        print("note: QNN had no cost for some ops (missing_ops_prefill_forward), which its cycles leave out")


if __name__ == "__main__":
    main()
