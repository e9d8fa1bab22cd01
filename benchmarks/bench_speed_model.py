"""The HTP speed model against the published device figures it is fitted to (qexp/speed/published.yaml): the fitted
parameters, every point with its prediction by the full fit and by the fit without it (leave-one-out), and the
median and worst leave-one-out error, decode and TTFT apart. Points not used in the fit are predicted and listed
with the reason.

    .venv/bin/python benchmarks/bench_speed_model.py [--markdown]
"""

from __future__ import annotations

import argparse

import numpy as np

from qexp.speed.fit import fitted


def rows(predictions, unit: str):
    out = []
    for p in predictions:
        point = p.point
        label = f" [{point.label}]" if point.label else ""
        what = f"TTFT {point.prompt} tok, AR-{point.ar_len}" if point.metric == "ttft_ms" else "decode"
        note = "" if point.use else f"not fitted: {point.why}"
        out.append([f"{point.model}{label}", point.quant, str(point.context), point.soc, what,
                    f"{point.value:g} {unit} ({point.kind})", f"{p.predicted:.1f}", f"{p.held_out:.1f}",
                    f"{100 * p.error:+.0f}%" if point.use else f"({100 * p.error:+.0f}%)", point.source, note])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args()
    fit = fitted()
    print(f"speed model {fit.source}; parameters: "
          + ", ".join(f"{k}={v:.4g}" for k, v in fit.model.as_dict().items()))
    header = ["model", "quant", "context", "SoC", "figure", "published", "fit", "held out", "LOO error", "source",
              "note"]
    for name, predictions, unit in (("decode tok/s", fit.decode, "tok/s"), ("TTFT ms", fit.ttft, "ms")):
        table = rows(predictions, unit)
        used = [p for p in predictions if p.point.use]
        errors = np.abs([p.error for p in used])
        print(f"\n{name}: leave-one-out error over {len(used)} fitted points: median {100 * np.median(errors):.1f}%, "
              f"worst {100 * errors.max():.1f}% ({max(used, key=lambda p: abs(p.error)).point.name})")
        if args.markdown:
            print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
            print("\n".join("| " + " | ".join(r) + " |" for r in table))
        else:
            widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
            for r in [header] + table:
                print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("\nsources: " + "; ".join(f"{k}: {v}" for k, v in fit.data.sources.items()))


if __name__ == "__main__":
    main()
