"""Diagnostic: how far a QDQ program's perplexity moves when its activations are rounded differently, and which way.

A deployed program (HTP) is another implementation of the QDQ program: its ops round differently. When its perplexity
departs from the QDQ program's, is that the program amplifying *any* implementation's rounding differences, or a
directional error of the device? This runs the QDQ program on the CPU with every computed activation's quantization
perturbed (each `fake_quantize` of the folded program, qexp.quant.fold, rounds x/s + e instead of x/s; the program's
inputs and ops that only copy values, EXACT_OPS, stay exact: a device rounds nothing there), on the run's evaluation
windows, and compares it with the unperturbed program on the same windows:

- `gauss:SIGMA`: e ~ N(0, SIGMA^2) LSB, fresh for every element of every forward, seeded: unbiased, as an
  implementation that rounds each op's output differently but not in one direction;
- `floor` / `ceil`: each activation rounded down / up (a bias of -1/2 / +1/2 LSB): an implementation that truncates.

Per variant: perplexity, its change against the unperturbed program with the paired-bootstrap 95% interval
(qexp.eval.compare), top-1 agreement, logits SQNR; and the perturbation's own size per op, measured on the first
window: the median over the program's activations (and over its norms' outputs) of one op's perturbed output against
its unperturbed output on the same input (per-position SQNR, as diagnostics/diag_htp_norm.py reports HTP's departure
from a norm's QDQ program, so the two compare).

`--only REGEX` perturbs just the activations whose `<module>:<op>` name matches (e.g. `norm:rms_norm`, the norms'
outputs). `--deployed-run RUN_ID` (a run of the same model, scheme, text and windows with a deployed phase) places
the device on the noise rows: what unbiased noise of the device's top-1 agreement with the QDQ program costs this
program, interpolated, next to what the device costs it. Equal: the device's departure behaves as unbiased rounding
noise the program amplifies; far above: it has a direction; below: it departs where the program does not care.

    .venv/bin/python diagnostics/diag_qdq_perturb.py model=gemma3_270m quant=16a4w quant.block_size=64
    .venv/bin/python diagnostics/diag_qdq_perturb.py --variants gauss:0.5,floor --seeds 3 quant=16a8w
    .venv/bin/python diagnostics/diag_qdq_perturb.py --only 'norm(_fn)?:rms_norm' --variants gauss:1 model=gemma3_270m

Everything is CPU; the figures are logged to MLflow (experiment `benchmarks`, CSV artifact).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402
from diagnostics.sqnr import per_position_sqnr_db  # noqa: E402
from qexp.quant.fold import fake_quantize  # noqa: E402

ROUNDINGS = ("round", "gauss", "floor", "ceil")


@dataclass(frozen=True)
class Perturbation:
    """How every activation of the program rounds: `round` (the QDQ program itself), `gauss` (N(0, sigma^2) LSB
    added before rounding, drawn from a generator seeded with `seed`), `floor` or `ceil`."""
    rounding: str = "round"
    sigma: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r}; one of {', '.join(ROUNDINGS)}")
        if self.rounding == "gauss" and not self.sigma > 0:
            raise ValueError("gauss needs a positive sigma in LSB, e.g. gauss:0.5")

    @property
    def label(self) -> str:
        return f"gauss:{self.sigma:g} seed {self.seed}" if self.rounding == "gauss" else self.rounding


def parse_variants(text: str, seeds: int) -> list[Perturbation]:
    """`gauss:0.5,floor` with 3 seeds -> gauss:0.5 seeds 0-2, floor."""
    variants = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        rounding, _, sigma = item.partition(":")
        if rounding == "gauss":
            try:
                variants += [Perturbation("gauss", float(sigma), seed) for seed in range(seeds)]
            except ValueError:
                raise SystemExit(f"--variants: {item!r} needs a number of LSB, e.g. gauss:0.5") from None
        else:
            variants.append(Perturbation(rounding))
    return variants


class _Active:
    """The perturbation the program's activations currently use (the graph calls a module-level function, so its
    setting lives here), its generator, and where one forward's per-op sizes go when recorded."""
    perturbation = Perturbation()
    generator: torch.Generator | None = None
    record: list | None = None
    tokens = 0


def perturbed_fake_quantize(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
                            where: str) -> torch.Tensor:
    """qexp.quant.fold.fake_quantize with its rounding replaced by the active Perturbation's (`round`: the very same
    float32 operations, bit for bit)."""
    p = _Active.perturbation
    out = x * (1.0 / scale)
    if p.rounding == "gauss":
        out.add_(torch.randn(out.shape, generator=_Active.generator).mul_(p.sigma)).round_()
    elif p.rounding == "floor":
        out.floor_()
    elif p.rounding == "ceil":
        out.ceil_()
    else:
        out.round_()
    out.clamp_(quant_min - zero_point, quant_max - zero_point).mul_(scale)
    if _Active.record is not None:
        exact = fake_quantize(x, scale, zero_point, quant_min, quant_max)
        _Active.record.append((where, per_position_sqnr_db(exact, out, _Active.tokens)))
    return out


# Ops that only move or gather values: on a device they copy their input's integers, so their quantization (the input's
# own scale, idempotent on the QDQ program's already-rounded values) rounds nothing and is not perturbed; nor are the
# program's inputs (masks, caches, RoPE tables), which the device receives already quantized.
EXACT_OPS = frozenset({"view", "reshape", "_unsafe_view", "transpose", "permute", "squeeze", "unsqueeze", "slice",
                       "select", "index", "cat", "expand", "clone", "embedding", "alias"})


def _op_name(node) -> str:
    """`rms_norm` for aten.rms_norm.default; the function's name for anything else."""
    target = node.target
    return target._opname if hasattr(target, "_opname") else getattr(target, "__name__", str(target))


def perturbable(module: torch.fx.GraphModule, only: str | None = None) -> tuple[int, int]:
    """Retarget, in place, the fake_quantize of every computed activation of a folded QDQ program
    (qexp.quant.fold.with_weights_dequantized) to perturbed_fake_quantize, naming where it sits (`<innermost
    module>:<op>`, e.g. `layers.3.ffn_norm:rms_norm`); with `only` (a regular expression), just those whose name it
    matches. Returns (perturbed, left exact: inputs, EXACT_OPS and the ones `only` leaves out)."""
    wanted = re.compile(only) if only else None
    perturbed = exact = 0
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target is not fake_quantize:
            continue
        producer = node.args[0]  # the quantize pair's own metadata carries no module stack
        if producer.op != "call_function" or _op_name(producer) in EXACT_OPS:
            exact += 1
            continue
        stack = producer.meta.get("nn_module_stack") or {}
        where = f"{next(reversed(stack.values()))[0] if stack else ''}:{_op_name(producer)}"
        if wanted is not None and not wanted.search(where):
            exact += 1
            continue
        node.target = perturbed_fake_quantize
        node.args = (*node.args, where)
        perturbed += 1
    module.recompile()
    return perturbed, exact


def evaluate_perturbed(folded, static, windows, perturbation: Perturbation, keep_logits: int):
    """(EvalResult, per-op sizes [(where, per-position SQNR dB)] on the first window) of the perturbable program."""
    from qexp.eval.perplexity import evaluate
    from qexp.models.static_llama import window_logits

    _Active.perturbation = perturbation
    _Active.generator = torch.Generator().manual_seed(perturbation.seed)
    _Active.tokens = static.ar_len
    record, calls = [], [0]

    def logits(ids):
        _Active.record = record if calls[0] == 0 and perturbation.rounding != "round" else None
        calls[0] += 1
        try:
            return window_logits(folded, static, ids)
        finally:
            _Active.record = None

    try:
        with torch.no_grad():
            result = evaluate(logits, windows, perturbation.label, keep_logits=keep_logits)
    finally:
        _Active.perturbation, _Active.generator = Perturbation(), None
    return result, record


def op_sizes(record: list) -> dict:
    """The perturbation's size per op: median per-position SQNR over all activations and over norms' outputs."""
    finite = [(where, db) for where, db in record if math.isfinite(db)]
    norms = [db for where, db in finite if where.split(":")[0].endswith("norm")]
    return {"op_sqnr_db_median": float(np.median([db for _, db in finite])) if finite else math.inf,
            "norm_sqnr_db_median": float(np.median(norms)) if norms else math.nan,
            "ops_perturbed": len(record)}


def diagnose(cfg, variants: list[Perturbation], only: str | None = None):
    """A DataFrame, one row per variant: ppl, Δ vs the unperturbed program [95% interval], top-1, logits SQNR, the
    perturbation's per-op size; the unperturbed program's perplexity, the text and windows in its `attrs`."""
    import pandas as pd

    from qexp.eval.compare import compare
    from qexp.pipeline import prepare
    from qexp.quant.fold import with_weights_dequantized
    from qexp.stages import SQNR_WINDOWS

    state = prepare(cfg, through="qdq")
    if state.qdq is None:
        raise SystemExit("the configured run has no QDQ phase (quant=fp?): nothing to perturb")
    reference = state.qdq.result
    # every quantize/dequantize pair kept: a repeat of a grid is a no-op only while rounding is exact, and each
    # consumer's pair is perturbed on its own, as this diagnostic always has
    folded = with_weights_dequantized(state.qdq.program.module, drop_redundant=False)
    perturbed, exact = perturbable(folded, only)
    if not perturbed:
        raise SystemExit(f"--only {only!r} matches no computed activation (names look like layers.3.ffn_norm:rms_norm)")
    rows = []
    for perturbation in variants:
        result, record = evaluate_perturbed(folded, state.qdq.static, state.windows, perturbation, SQNR_WINDOWS)
        delta = compare(result, reference, "perturbed", "qdq")
        rows.append({"variant": perturbation.label, "rounding": perturbation.rounding, "sigma_lsb": perturbation.sigma,
                     "seed": perturbation.seed, "ppl": result.metrics()["ppl"],
                     "delta_pct": 100 * delta["ppl_perturbed_vs_qdq"],
                     "ci_low_pct": 100 * delta["ppl_perturbed_vs_qdq_ci_low"],
                     "ci_high_pct": 100 * delta["ppl_perturbed_vs_qdq_ci_high"],
                     "top1": delta["top1_agreement_perturbed_vs_qdq"],
                     "logits_sqnr_db": delta.get("logits_sqnr_db_perturbed_vs_qdq", math.nan), **op_sizes(record)})
        print(f"[perturb] {perturbation.label}: ppl {rows[-1]['ppl']:.3f} ({rows[-1]['delta_pct']:+.2f}% "
              f"[{rows[-1]['ci_low_pct']:+.2f}, {rows[-1]['ci_high_pct']:+.2f}])", flush=True)
    table = pd.DataFrame(rows)
    table.attrs.update({"activations": perturbed, "activations_exact": exact, "ppl_qdq": reference.metrics()["ppl"],
                        "tokens": int(reference.logprobs.size), "windows": int(reference.logprobs.shape[0]),
                        "text": str(cfg.text.name), "window_len": int(cfg.eval.seq_len),
                        "text_sha256": state.tags.get("text_sha256")})
    return table


def noise_cost_at(table, top1: float) -> float | None:
    """The Δ perplexity (%) unbiased rounding noise costs this program at a top-1 agreement of `top1` with it: linear
    interpolation between the gauss rows' per-sigma means (and the program itself, agreement 1 at 0%); None outside
    the measured range."""
    gauss = table[table.rounding == "gauss"].groupby("sigma_lsb")[["top1", "delta_pct"]].mean()
    agreement, cost = zip(*sorted([(1.0, 0.0), *zip(gauss.top1, gauss.delta_pct)]))
    if not agreement[0] <= top1 <= agreement[-1]:
        return None
    return float(np.interp(top1, agreement, cost))


def fetch_run(store: str, run_id: str):
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(store).get_run(run_id)
    except Exception as error:  # noqa: BLE001 - MLflow raises its own exception types for a missing run
        raise SystemExit(f"--deployed-run {run_id}: not found in {store} ({type(error).__name__})") from None


def deployed_figures(run, cfg, meta: dict | None = None) -> dict:
    """A deployed run's Δ vs its QDQ program and top-1 agreement; refused unless it is the same model and scheme
    (before the diagnosis) on the same text and windows (`meta`, after it), else the comparison means nothing."""
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    checks = [("model", params.get("model.name"), str(cfg.model.name)),
              ("scheme", tags.get("scheme"), str(cfg.quant.scheme))]
    if meta is not None:
        checks += [("text", tags.get("text_sha256"), meta["text_sha256"]),
                   ("windows", metrics.get("deployed_eval_windows"), float(meta["windows"])),
                   # the same QDQ program: its perplexity on those windows, to the last digit MLflow keeps
                   ("QDQ perplexity", round(metrics.get("ppl_qdq", math.nan), 6), round(meta["ppl_qdq"], 6))]
    mismatches = [f"{what} {theirs!r} (here {ours!r})" for what, theirs, ours in checks if theirs != ours]
    if "ppl_deployed_vs_qdq" not in metrics:
        mismatches.append("no deployed-vs-QDQ comparison")
    if mismatches:
        raise SystemExit(f"--deployed-run {run.info.run_id}: not comparable with this diagnosis: "
                         f"{'; '.join(mismatches)}")
    return {"target": tags.get("target", "?"), "delta_pct": 100 * metrics["ppl_deployed_vs_qdq"],
            "ci_low_pct": 100 * metrics.get("ppl_deployed_vs_qdq_ci_low", math.nan),
            "ci_high_pct": 100 * metrics.get("ppl_deployed_vs_qdq_ci_high", math.nan),
            "top1": metrics["top1_agreement_deployed_vs_qdq"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="round,gauss:0.5,gauss:1,floor,ceil",
                        help="comma list of round, gauss:SIGMA (LSB), floor, ceil")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per gauss variant")
    parser.add_argument("--only", help="perturb only the activations whose `<module>:<op>` name this regular "
                        "expression matches (e.g. 'norm:' for the norms' outputs)")
    parser.add_argument("--deployed-run", help="an MLflow run id of the same config with a deployed phase (HTP) on "
                        "the same windows: print what unbiased noise of its top-1 agreement costs this program")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    variants = parse_variants(args.variants, args.seeds)  # a bad list fails before the model loads

    import mlflow
    import pandas as pd
    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp.tracking.address import resolve_uri

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=16a4w_wikitext", *args.overrides, "backend=none"])
    store = resolve_uri(cfg.tracking)
    deployed_run = fetch_run(store, args.deployed_run) if args.deployed_run else None
    if deployed_run is not None:
        deployed_figures(deployed_run, cfg)  # the wrong model or scheme fails before the heavy work
    table = diagnose(cfg, variants, args.only)
    meta = table.attrs
    pd.set_option("display.width", 200)
    matching = f" matching {args.only!r}" if args.only else ""
    print(f"\n{cfg.model.name} {cfg.quant.scheme}: the QDQ program (ppl {meta['ppl_qdq']:.3f}) with its "
          f"{meta['activations']} computed activations{matching} rounded otherwise ({meta['activations_exact']} "
          f"left exact), CPU; {meta['windows']} windows x "
          f"{meta['window_len']} tokens of {meta['text']} ({meta['tokens']} predicted)")
    shown = ["variant", "ppl", "delta_pct", "ci_low_pct", "ci_high_pct", "top1", "logits_sqnr_db",
             "op_sqnr_db_median", "norm_sqnr_db_median"]
    print(table[shown].to_string(index=False, float_format="%.2f"))
    gauss = table[table.rounding == "gauss"].groupby("sigma_lsb").delta_pct.agg(["mean", "min", "max", "count"])
    if len(gauss):
        print(f"\nΔ ppl (%) over seeds per gauss sigma (LSB):\n{gauss.to_string(float_format='%.2f')}")

    deployed = None
    if deployed_run is not None:
        deployed = deployed_figures(deployed_run, cfg, meta)
        cost = noise_cost_at(table, deployed["top1"])
        at = "outside the agreements the gauss rows reached" if cost is None else f"{cost:+.2f}%"
        print(f"\ndeployed run {args.deployed_run} ({deployed['target']}): {deployed['delta_pct']:+.2f}% "
              f"[{deployed['ci_low_pct']:+.2f}, {deployed['ci_high_pct']:+.2f}] vs this QDQ program at top-1 agreement "
              f"{deployed['top1']:.3f}; unbiased rounding noise of that agreement costs it {at} (interpolated "
              f"between the gauss rows' means)")
        deployed["noise_cost_pct"] = math.nan if cost is None else cost
    with benchmark_run(store, f"diag_qdq_perturb-{cfg.model.name}-{cfg.quant.scheme}",
                       "diag_qdq_perturb", {"target": "cpu", "model": cfg.model.name, "scheme": cfg.quant.scheme,
                                            "text": meta["text"], "only": args.only or "all"}):
        mlflow.log_metrics({"ppl_qdq": meta["ppl_qdq"], "tokens": meta["tokens"], "windows": meta["windows"],
                            "window_len": meta["window_len"], "activations": meta["activations"],
                            "activations_exact": meta["activations_exact"],
                            **({f"deployed_{k}": v for k, v in deployed.items() if k != "target"} if deployed else {})})
        mlflow.log_text(table.to_csv(index=False), "diag_qdq_perturb.csv")


if __name__ == "__main__":
    main()
