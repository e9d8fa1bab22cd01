"""Diagnostic: how much of HTP's logits each part of eval.htp_exact's arithmetic model accounts for.

Whole-model perplexity on 8 windows cannot tell a few tenths of a percent apart, and top-1 agreement moves by about
its own noise; the logits themselves can. The deployed HTP program (the run's cached `.pte`, x86 emulator) runs the
first AR-N tokens (prefill graph, empty cache) of the first `--windows` evaluation windows; the prefill graph's QDQ
program computes the same tokens with each QDQ arithmetic: the fake-quant program, htp_exact with every model
(qexp/quant/htp_arithmetic.py), with each candidate model added, htp_exact without each model in turn (what that
model contributes), and each model alone. Per arithmetic, against HTP's logits: SQNR (dB, whole tensor), the mean KL
divergence between the two next-token distributions (nats per token) and top-1 agreement. Logged to MLflow
(experiment `benchmarks`).

--perplexity asks the same of the perplexity a run reports: the QDQ phase with each arithmetic on the run's own
windows (`eval.limit`), against HTP's scores of the windows the HTP phase scores (qexp.backends.htp.phase.
score_on_emulator: `backend.eval_tokens`; read from the cache a `backend=htp` run of the same config left, else
computed on the emulator): HTP's Δ from each with its
95% interval (paired bootstrap over windows, qexp/eval/uncertainty.py) and top-1 agreement. One QDQ evaluation per
arithmetic: SmolLM2 on 32 windows ~40 s each.

    .venv/bin/python diagnostics/diag_htp_exact_ops.py [--windows 8] [hydra overrides, e.g. quant=16a8w]
    .venv/bin/python diagnostics/diag_htp_exact_ops.py model=gemma3_270m quant=16a8w quant.block_size=64
    .venv/bin/python diagnostics/diag_htp_exact_ops.py --perplexity eval.limit=32 backend.eval_tokens=8192

The QDQ program here is the deployed prefill graph's, on the inputs qexp's HTP runner gives it: where the two differ
at all it is because of the arithmetic. SmolLM2 ~3 min once its `.pte` is cached; Gemma-3-270M ~13 GiB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlflow
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402


def agreement(htp: torch.Tensor, qdq: torch.Tensor) -> dict:
    """SQNR (dB) of the QDQ logits against HTP's, mean KL(HTP || QDQ) per position (nats) and top-1 agreement."""
    from qexp.eval.compare import sqnr_db

    log_p, log_q = torch.log_softmax(htp.double(), -1), torch.log_softmax(qdq.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    top1 = (htp.argmax(-1) == qdq.argmax(-1)).double().mean().item()
    return {"logits_sqnr_db": sqnr_db(htp, qdq), "kl_nats": kl, "top1": top1}


def metric_prefix(label: str) -> str:
    """An arithmetic's label as an MLflow metric name ("+" is not allowed there)."""
    return label.replace(" + ", " plus ").replace(" ", "_")


def arithmetics() -> dict:
    """{label: htp_exact models (None: the fake-quant program)}."""
    from qexp.quant.htp_arithmetic_pass import CANDIDATE_MODELS, MODELS

    variants = {"fake_quant": None, "htp_exact": MODELS}
    variants.update({f"htp_exact + {m}": MODELS + (m,) for m in CANDIDATE_MODELS})
    variants.update({f"without {m}": tuple(x for x in MODELS if x != m) for m in MODELS})
    variants.update({f"only {m}": (m,) for m in MODELS})
    return variants


def attribute(cfg, n_windows: int) -> tuple[dict, dict]:
    """({arithmetic label: agreement with HTP}, facts: model, positions, emulator seconds, what htp_exact modelled)."""
    from diagnostics.diag_htp_ops import first_chunk_inputs
    from qexp.backends.htp.lower import PREFILL_GRAPH, deploy_graph, compile_pte, graph_ar_lens
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.backends.htp.runner import HtpRunner
    from qexp.pipeline import prepare
    from qexp.core.provenance import library_versions
    from qexp.quant.fold import with_weights_dequantized
    from qexp.quant.w4_lowering import w4_lowering_of
    from qexp.upstream.private import tree_leaves

    state = prepare(cfg, through="qdq")
    ensure_qnn_sdk(state.cache)
    stats = torch.load(state.qdq.program.stats_path, weights_only=True)
    graph = deploy_graph(state.deploy_model, cfg, PREFILL_GRAPH, graph_ar_lens(cfg.backend)[PREFILL_GRAPH],
                          state.deploy_static.r3, stats, state.timer)
    deployed = compile_pte(state.deploy_model, cfg, state.qdq.program, state.deploy_static.r3, state.cache, state.timer,
                           library_versions())
    runner = HtpRunner(deployed)
    windows = [state.windows.ids[w] for w in range(min(n_windows, len(state.windows.ids)))]
    started = time.perf_counter()
    inputs, htp = [], []
    for ids in windows:
        _, floats, ar = first_chunk_inputs(ids, graph["inputs"], graph["encodings"], int(cfg.backend.max_seq_len),
                                           graph["meta"].get("get_sliding_window"))
        inputs.append(floats)
        htp.append(runner.prefill_logits([int(t) for t in ids[:ar]]))
    htp = torch.cat(htp).float()
    facts = {"positions": htp.shape[0], "tokens_per_window": ar, "windows": len(windows),
             "emulator_s": time.perf_counter() - started}
    lowering = w4_lowering_of(cfg)  # as this run's HTP program gets its 4-bit weights
    rows = {}
    for label, models in arithmetics().items():
        program = with_weights_dequantized(graph["module"], None if models is None else lowering,
                                           htp_exact_models=models)
        if label == "htp_exact":
            facts["modelled"] = program.htp_counts.describe()
        with torch.no_grad():
            qdq = torch.cat([tree_leaves(program(*floats))[0].float().reshape(ar, -1) for floats in inputs])
        rows[label] = agreement(htp, qdq)
        del program, qdq
    return rows, facts


def attribute_perplexity(cfg) -> tuple[dict, dict]:
    """({arithmetic label: ppl_qdq, HTP's Δ from it with its interval, top-1 agreement}, facts) on the run's windows,
    as `python -m qexp ... backend=htp [eval.htp_exact=true]` would report them."""
    from qexp.backends.htp.lower import compile_pte
    from qexp.backends.htp.phase import score_on_emulator
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.backends.htp.runner import HtpRunner
    from qexp.eval.compare import compare
    from qexp.eval.perplexity import evaluate
    from qexp.models.static_llama import window_logits
    from qexp.pipeline import prepare
    from qexp.core.provenance import library_versions
    from qexp.quant.fold import with_weights_dequantized
    from qexp.quant.w4_lowering import w4_lowering_of

    state = prepare(cfg, through="qdq")
    ensure_qnn_sdk(state.cache)
    deployed = compile_pte(state.deploy_model, cfg, state.qdq.program, state.deploy_static.r3, state.cache, state.timer,
                           library_versions())
    htp, _, _, hit = score_on_emulator(deployed, HtpRunner(deployed), state.windows, cfg.backend,
                                       state.deploy_model.tokenizer, state.cache)  # as the run's HTP phase scores
    subset = htp.windows
    facts = {"windows": state.windows.n_windows, "htp_windows": subset.n_windows, "htp_tokens": subset.n_predicted,
             "htp_cache_hit": hit, "ppl_deployed": htp.metrics()["ppl"],
             "ppl_qdq_phase": state.qdq.result.metrics()["ppl"]}  # what the run itself reports (its eval.htp_exact)
    lowering = w4_lowering_of(cfg)
    rows, fake = {}, None
    for label, models in arithmetics().items():
        program = with_weights_dequantized(state.qdq.program.module, None if models is None else lowering,
                                           htp_exact_models=models)
        # F821 false positive: ruff sees the `del program` below; evaluate() calls the lambda before it
        qdq = evaluate(lambda ids: window_logits(program, state.deploy_static, ids), state.windows, label)  # noqa: F821
        fake = qdq if models is None else fake  # arithmetics() lists the fake-quant program first
        delta = compare(htp, qdq.head(subset), "deployed", "qdq")
        shift = compare(qdq, fake, "qdq", "fake_quant")  # how far this arithmetic moves the QDQ phase, all windows
        rows[label] = {"ppl_qdq": qdq.metrics()["ppl"],
                       **{k.replace("_deployed_vs_qdq", ""): v for k, v in delta.items() if "sqnr" not in k},
                       **{k.replace("_qdq_vs_fake_quant", "_shift"): v for k, v in shift.items()
                          if k.startswith("ppl_")}}
        del program
    return rows, facts


def print_perplexity(cfg, rows: dict, facts: dict) -> None:
    print(f"{cfg.model.name} {cfg.quant.scheme}: HTP (target=x86_emulator, ppl {facts['ppl_deployed']:.3f} on "
          f"{facts['htp_tokens']} tokens of {facts['htp_windows']} windows; scores "
          f"{'from the cache' if facts['htp_cache_hit'] else 'computed now'}) against the QDQ phase with each "
          f"arithmetic ({facts['windows']} windows)")
    print(f"  {'QDQ arithmetic':38s} {'ppl QDQ':>8s}   {'QDQ vs fake quant':26s} {'HTP vs QDQ [95% interval]':26s} "
          f"{'top-1':>6s}")
    for label, row in rows.items():
        print(f"  {label:38s} {row['ppl_qdq']:8.3f}   {interval_cell(row, 'ppl_shift'):26s} "
              f"{interval_cell(row, 'ppl'):26s} {row['top1_agreement']:6.3f}")


def interval_cell(row: dict, name: str) -> str:
    """`+0.51% [+0.07, +0.97]`, `~` where the interval spans zero (none: too few units to resample)."""
    low, high = row.get(f"{name}_ci_low", float("nan")), row.get(f"{name}_ci_high", float("nan"))
    return f"{100 * row[name]:+.2f}% [{100 * low:+.2f}, {100 * high:+.2f}]{' ~' if low <= 0 <= high else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8, help="logits: windows whose first AR-N tokens are scored")
    parser.add_argument("--perplexity", action="store_true", help="the reported perplexity instead of the logits")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp.tracking.address import resolve_uri

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=16a4w_wikitext", "backend=htp", *args.overrides])
    if args.perplexity:
        rows, facts = attribute_perplexity(cfg)
        print_perplexity(cfg, rows, facts)
        results = {f"{metric_prefix(label)}_{k}": v for label, row in rows.items() for k, v in row.items()}
        with benchmark_run(resolve_uri(cfg.tracking), f"diag_htp_exact_ppl-{cfg.model.name}", "diag_htp_exact_ops",
                           {"target": "x86_emulator", "model": cfg.model.name, "scheme": str(cfg.quant.scheme),
                            "windows": str(facts["windows"]), "htp_tokens": str(facts["htp_tokens"])}):
            mlflow.log_metrics({**results, "ppl_deployed": facts["ppl_deployed"]})
        return
    rows, facts = attribute(cfg, args.windows)
    print(f"{cfg.model.name} {cfg.quant.scheme}: the deployed HTP program (target=x86_emulator) against the prefill "
          f"graph's QDQ program with each arithmetic, first {facts['tokens_per_window']} tokens of {facts['windows']} "
          f"windows ({facts['positions']} positions; emulator {facts['emulator_s']:.0f} s); htp_exact: "
          f"{facts['modelled']}")
    print(f"  {'QDQ arithmetic':38s} {'logits SQNR':>11s} {'KL (nats)':>10s} {'top-1':>6s}")
    for label, row in rows.items():
        print(f"  {label:38s} {row['logits_sqnr_db']:8.2f} dB {row['kl_nats']:10.5f} {row['top1']:6.3f}")
    results = {f"{metric_prefix(label)}_{k}": v for label, row in rows.items() for k, v in row.items()}
    with benchmark_run(resolve_uri(cfg.tracking), f"diag_htp_exact_ops-{cfg.model.name}", "diag_htp_exact_ops",
                       {"target": "x86_emulator", "model": cfg.model.name, "scheme": str(cfg.quant.scheme),
                        "positions": str(facts["positions"])}):
        mlflow.log_metrics({**results, "emulator_s": facts["emulator_s"]})


if __name__ == "__main__":
    main()
