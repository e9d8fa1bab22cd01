"""The HTP speed model against the published device figures it is fitted to (qexp/speed/published.yaml): the fitted
parameters, every point with its prediction by the full fit and by fits that never saw it (leave one point out, one
model out, one source out), the median and worst held-out error of the measurements, how far the held-out fits
predict CI floors below them, and the same summary for simpler forms of the model (one parameter held), so the
form is chosen on leave-one-model-out error. Points not used in the fit are predicted and listed with the reason.

    .venv/bin/python benchmarks/bench_speed_model.py [--markdown]
"""

from __future__ import annotations

import argparse

from qexp.speed.fit import HOLD_OUTS, PRODUCT_FORM, fitted

# forms: every term (v3's), the product's (no KV-read term), and the product's without one more term
FORMS = {"every term (v3's form)": (), "product: no KV-read term": PRODUCT_FORM,
         "... and no per-head-op cost": PRODUCT_FORM + (("head_op_us", 0.0),),
         "... and no Genie speed-up": PRODUCT_FORM + (("genie_speedup", 1.0),),
         "... and no NPU-generation growth": PRODUCT_FORM + (("compute_exponent", 0.0),)}


def rows(predictions, unit: str):
    out = []
    for p in predictions:
        point = p.point
        label = f" [{point.label}]" if point.label else ""
        what = f"TTFT {point.prompt} tok, AR-{point.ar_len}" if point.metric == "ttft_ms" else "decode"
        note = "" if point.use else f"not fitted: {point.why}"
        errors = [f"{100 * p.error_of(h):+.0f}%" if point.use else f"({100 * p.error_of(h):+.0f}%)" for h in HOLD_OUTS]
        out.append([f"{point.model}{label}", point.quant, str(point.context), point.soc, what,
                    f"{point.value:g} {unit} ({point.kind})", f"{p.predicted:.1f}", *errors, point.source, note])
    return out


def summary(fit, metric: str) -> str:
    parts = []
    for h in HOLD_OUTS if metric == "decode" else ("point",):
        worst = max(fit.measured(metric), key=lambda p: abs(p.error_of(h)))
        parts.append(f"leave one {h} out: median {100 * fit.error(metric, 'median', h):.1f}%, worst "
                     f"{100 * fit.error(metric, 'worst', h):.1f}% ({worst.point.model} {worst.point.quant} "
                     f"{worst.point.soc}, {worst.point.source})")
    if metric == "decode":
        for h in HOLD_OUTS:
            misses = fit.floor_misses(h)
            worst = min((p.below_floor(h) for p in misses), default=0.0)
            parts.append(f"floors predicted below (leave one {h} out): {len(misses)} of "
                         f"{sum(p.point.use and p.point.is_floor for p in fit.decode)}, worst {100 * worst:+.1f}%")
    low, high = fit.band(metric)
    parts.append(f"interval on an estimate: x{low:.2f} .. x{high:.2f}")
    return "\n  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args()
    fit = fitted()
    print(f"speed model {fit.source}; parameters: "
          + ", ".join(f"{k}={v:.4g}" for k, v in fit.model.as_dict().items()))
    header = ["model", "quant", "context", "SoC", "figure", "published", "fit", "out: point", "out: model",
              "out: source", "source", "note"]
    for name, metric, predictions, unit in (("decode tok/s", "decode", fit.decode, "tok/s"),
                                             ("TTFT ms", "ttft", fit.ttft, "ms")):
        table = rows(predictions, unit)
        print(f"\n{name}, over {len(fit.measured(metric))} fitted measurements:\n  {summary(fit, metric)}")
        if args.markdown:
            print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
            print("\n".join("| " + " | ".join(r) + " |" for r in table))
        else:
            widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
            for r in [header] + table:
                print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("\nforms (decode, median / worst held-out error of the measurements):")
    for label, pinned in FORMS.items():
        form = fitted(None, pinned)
        print(f"  {label:34s} " + "  ".join(
            f"{h}: {100 * form.error('decode', 'median', h):.1f}% / {100 * form.error('decode', 'worst', h):.1f}%"
            for h in HOLD_OUTS) + f"  floors missed (model out): {len(form.floor_misses('model'))}")
    print("\nsources: " + "; ".join(f"{k}: {v}" for k, v in fit.data.sources.items()))


if __name__ == "__main__":
    main()
