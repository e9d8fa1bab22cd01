"""Run every `conf/experiment/*` on the tiny model and write its perplexity-type metrics to a JSON file.

A refactoring check: run it before and after a change that must not change results, then compare the two files
(`--compare BEFORE.json AFTER.json` prints every metric that differs; exit 1 if any does).

    .venv/bin/python scripts/tiny_experiments.py --out /tmp/before.json
    .venv/bin/python scripts/tiny_experiments.py --out /tmp/after.json
    .venv/bin/python scripts/tiny_experiments.py --compare /tmp/before.json /tmp/after.json

Each experiment runs as its own `python -m qexp` process on a fresh cache and store (cold path), with the tiny
model and short windows so that the whole set takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "eval.seq_len=64", "eval.limit=3", "calibration.limit=3"]
# Keys that moved between layouts: try the current names; the old ones are the fallback.
BENCH = {"prompt_len": 8, "new_tokens": 4, "repeats": 1}
HTP = {"backend.": ["backend.prefill_ar_len=16", "backend.eval_tokens=64", "backend.eval_kv_tokens=8"],
       "": ["backend.prefill_ar_len=16", "eval.htp_tokens=64", "eval.htp_kv_tokens=8"]}  # before the restructure
SIZES = [[f"{prefix}bench.{k}={v}" for k, v in BENCH.items()] + htp
         for prefix in ("backend.", "") for htp in (HTP[prefix], [])] + [[]]
RESULT_PREFIXES = ("ppl", "word_ppl", "byte_ppl", "bits_per_byte", "nll", "top1_", "logits_sqnr")


def experiments() -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def run_all(out: Path, only: list[str] | None) -> None:
    import mlflow

    work = Path(tempfile.mkdtemp(prefix="qexp-tiny-"))
    store = f"sqlite:///{work / 'mlruns.db'}"
    env = {**os.environ, "QEXP_CACHE_DIR": str(work / "cache")}
    results = {}
    for name in only or experiments():
        for sizes in SIZES:  # the first set of size overrides this experiment's config accepts
            command = [sys.executable, "-m", "qexp", f"+experiment={name}", *TINY, *sizes,
                       f"tracking.uri={store}", "tracking.experiment=tiny", f"tracking.run_name={name}"]
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode == 0 or "qexp:" in proc.stderr:  # ran, or failed inside qexp (not composition)
                break
        print(f"{name}: exit {proc.returncode}", flush=True)
        if proc.returncode != 0:
            results[name] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        mlflow.set_tracking_uri(store)
        run = mlflow.search_runs(experiment_names=["tiny"], filter_string=f"attributes.run_name = '{name}'",
                                 order_by=["attributes.start_time DESC"], max_results=1).iloc[0]
        results[name] = {k[len("metrics."):]: float(v) for k, v in run.items()
                         if k.startswith("metrics.") and k[len("metrics."):].startswith(RESULT_PREFIXES)
                         and v == v}
    out.write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"wrote {out} ({work} holds the store and cache)")


# Metrics renamed by the restructure into backends (old name -> new name): compared by value under the new name.
RENAMED = {"ppl_htp": "ppl_deployed", "word_ppl_htp": "word_ppl_deployed", "byte_ppl_htp": "byte_ppl_deployed",
           "bits_per_byte_htp": "bits_per_byte_deployed", "nll_htp": "nll_deployed",
           "ppl_htp_vs_qdq": "ppl_deployed_vs_qdq", "top1_agreement_htp_vs_qdq": "top1_agreement_deployed_vs_qdq",
           "logits_sqnr_db_qdq": "logits_sqnr_db_qdq_vs_fp", "logits_sqnr_db_deployed": "logits_sqnr_db_deployed_vs_fp"}


def compare(before: Path, after: Path) -> int:
    """Every metric of `before` must have the same value in `after` (under its new name); metrics only in `after`
    are listed as additions, not differences."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    a = {name: {RENAMED.get(k, k): v for k, v in metrics.items()} for name, metrics in a.items()}
    differences = 0
    for name in sorted(set(a) | set(b)):
        ma, mb = a.get(name, {}), b.get(name, {})
        for metric in sorted(ma):
            if ma[metric] != mb.get(metric):
                differences += 1
                print(f"{name}: {metric}: {ma[metric]} -> {mb.get(metric)}")
        added = sorted(set(mb) - set(ma))
        if added:
            print(f"{name}: new: {', '.join(added)}")
    n = sum(len(v) for v in a.values())
    print(f"{differences} differences over {n} metrics of {len(a)} experiments")
    return 1 if differences else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    run_all(args.out or Path("tiny_experiments.json"), args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
