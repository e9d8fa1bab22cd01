"""Two runs side by side on the terminal: `python -m qexp.report --compare RUN_A RUN_B`.

The params that differ, the metrics with B-A and B/A-1, and loud flags where a difference means nothing: perplexities
from different text or windows, speeds from different targets or machines. Where both runs scored the very same
windows, the perplexity ratios get the paired 95% interval of qexp/eval/uncertainty.py, so a difference within the
noise shows as such (`~`). Reads the store only: a dead RUNNING run is reported, not reconciled.

Finding the runs: qexp/report/compare_fetch.py; the text on the terminal: qexp/report/compare_render.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from qexp.eval.uncertainty import unit_interval
from qexp.report.compare_fetch import RunSummary, tracking_client, run_summary, resolve_run
from qexp.report.paired import per_window as window_loglikelihoods
from qexp.report.query import LEGACY_NAMES, with_current_names
from qexp.report.table import COMPARABILITY, EMULATED

# Where a run is tracked or cached changes no result: the keys provenance.config_hash leaves out.
BOOKKEEPING = ("tracking.", "cache.", "cache_dir", "verbose")
# The headline perplexities first, in the order of a run's phases; other perplexities follow, then the rest sorted.
HEADLINE = ("ppl_fp", "ppl_qdq", "ppl_deployed", "ppl_fp_sub", "ppl_qdq_sub")
PHASES = ("fp", "qdq", "deployed")  # eval/per_window.csv holds ll_<phase> for the phases a run scored per window
PERPLEXITY = re.compile(r"^(word_|byte_)?ppl_")
# Measured on the evaluation windows: meaningless between runs on different text or windows.
WINDOW_METRICS = re.compile(r"^(ppl|word_ppl|byte_ppl|bits_per_byte|nll|top1_agreement|logits_sqnr_db)_")
# A relative difference within one run (ppl_qdq_vs_fp = PPL QDQ / PPL FP - 1): shown in %, compared in points.
RELATIVE = re.compile(r"^ppl_.*_vs_")
# Speed of the deployed program, and the stages' wall-clock times: both depend on where the run ran.
TIMING = re.compile(r"(_ms|_tok_s|_us_per_token)$|^time_")
# A phone speed estimate (qexp/speed): comparable between runs of one estimate version on one SoC, whatever host ran
# them; its error is the model's, shared by both runs' figures.
ESTIMATE = re.compile(r"_est(_err|_low|_high|_extrapolated)?$")
INTERVAL_SUFFIXES = ("_ci_low", "_ci_high", "_ci_units")
VALUE_WIDTH = 44  # a param value longer than this (quant.overrides, prompts) is cut; the MLflow UI has it whole


@dataclass
class MetricRow:
    name: str
    a: float
    b: float
    a_interval: Tuple[float, float] = (np.nan, np.nan)  # the run's own 95% interval of a relative metric
    b_interval: Tuple[float, float] = (np.nan, np.nan)
    paired: Tuple[float, float] = (np.nan, np.nan)  # 95% interval of B/A - 1 over the windows both scored
    flag: str = ""


@dataclass
class RunComparison:
    a: RunSummary
    b: RunSummary
    params_differ: List[Tuple[str, str, str]]  # (key, A's value, B's value); '-' where a run lacks the key
    params_equal: int
    metrics: List[MetricRow]
    metrics_equal: List[str]  # non-perplexity metrics with the same value in both runs
    not_comparable: Optional[str] = None  # e.g. "window count 3 vs 4"
    timing_differs: Optional[str] = None  # e.g. "target x86_emulator vs cpu"
    notes: List[str] = field(default_factory=list)


# ---------------------------------------------------------------- the two runs as one frame
def _frame(run_a, run_b) -> pd.DataFrame:
    """Two rows of `params.*`, `metrics.*`, `tags.*` under today's names (an old run's ppl_htp is ppl_deployed)."""
    rows = [{**{f"params.{k}": v for k, v in run.data.params.items()},
             **{f"metrics.{k}": v for k, v in run.data.metrics.items()},
             **{f"tags.{k}": v for k, v in run.data.tags.items()}} for run in (run_a, run_b)]
    frame = with_current_names(pd.DataFrame(rows))
    # the legacy columns now live under today's names: keeping them would list each value twice
    return frame.drop(columns=[c for c in LEGACY_NAMES.values() if c in frame])


def _present(value) -> bool:
    return not (value is None or (isinstance(value, float) and np.isnan(value)))


def _section(frame: pd.DataFrame, prefix: str) -> Tuple[Dict[str, object], Dict[str, object]]:
    """{name: value} of each run for the columns under `prefix`, absent values left out."""
    columns = [c for c in frame if c.startswith(prefix)]
    return tuple({c[len(prefix):]: frame.at[i, c] for c in columns if _present(frame.at[i, c])} for i in (0, 1))


def _shown(value: Optional[str]) -> str:
    if value is None:
        return "-"
    value = str(value)
    return value if len(value) <= VALUE_WIDTH else value[:VALUE_WIDTH - 1] + "…"


def _params(frame: pd.DataFrame) -> Tuple[List[Tuple[str, str, str]], int]:
    a, b = _section(frame, "params.")
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(BOOKKEEPING))
    differ = [(k, _shown(a.get(k)), _shown(b.get(k))) for k in keys if a.get(k) != b.get(k)]
    return differ, len(keys) - len(differ)


# Logged only since qexp pinned PyTorch's CPU kernels (the CPU model: by every run, but not by runs written by other
# tools): a run without it still pairs on the same windows, noted.
KEYS_OLDER_RUNS_LACK = ("tags.numerics.cpu_capability", "tags.numerics.mkl_cbwr", "tags.cpu")


def _not_comparable(frame: pd.DataFrame) -> Tuple[Optional[str], Optional[str], bool]:
    """(what differs among text, window length, window count and CPU kernels; what could not be checked; whether
    what could not be checked rules out pairing the windows), as in table.py."""
    differ, unknown, blocking = [], [], False
    for key, what in COMPARABILITY.items():
        a, b = (frame.at[i, key] if key in frame and _present(frame.at[i, key]) else None for i in (0, 1))
        if a is None or b is None:
            unknown.append(what)
            blocking = blocking or key not in KEYS_OLDER_RUNS_LACK
        elif str(a) != str(b):
            short = (lambda v: str(v)[:10]) if key == "tags.text_sha256" else str
            differ.append(f"{what} {short(a)} vs {short(b)}")
    return ("; ".join(differ) or None), (", ".join(unknown) or None), blocking


def _timing_differs(frame: pd.DataFrame) -> Optional[str]:
    """Why the two runs' timings do not compare: another target (the emulator is not a phone) or another CPU."""
    a, b = _section(frame, "tags.")
    target_a, target_b = a.get("target", "pytorch"), b.get("target", "pytorch")
    reasons = []
    if target_a != target_b:
        reasons.append(f"target {target_a} vs {target_b}")
    if a.get("cpu") and b.get("cpu") and a["cpu"] != b["cpu"]:
        reasons.append(f"cpu {a['cpu']} vs {b['cpu']}")
    if not reasons:
        return None
    if {target_a, target_b} & EMULATED:
        reasons.append("x86_emulator timings are emulator timings, not phone speed")
    return "; ".join(reasons)


# ---------------------------------------------------------------- metrics
def _order(name: str) -> Tuple[int, int, str]:
    if name in HEADLINE:
        return 0, HEADLINE.index(name), name
    if PERPLEXITY.match(name) and not RELATIVE.match(name):
        return 1, 0, name
    return 2, 0, name


def _metric_rows(frame: pd.DataFrame, not_comparable: bool, timing_differs: bool
                 ) -> Tuple[List[MetricRow], List[str]]:
    a, b = _section(frame, "metrics.")
    tags_a, tags_b = _section(frame, "tags.")
    estimate_differs = any(tags_a.get(k) != tags_b.get(k) for k in ("speed_source", "speed_soc"))
    # a relative metric's interval rides in its row, not in rows of its own
    names = sorted((n for n in set(a) | set(b) if not n.endswith(INTERVAL_SUFFIXES)), key=_order)
    rows, equal = [], []
    for name in names:
        va, vb = float(a.get(name, np.nan)), float(b.get(name, np.nan))
        if va == vb and _order(name)[0] == 2:
            equal.append(name)  # the same in both: listed by name only, the perplexities always get their row
            continue
        interval = lambda run: (run.get(f"{name}_ci_low", np.nan), run.get(f"{name}_ci_high", np.nan))  # noqa: E731
        flag = ("NOT COMPARABLE" if not_comparable and WINDOW_METRICS.match(name)
                else ("estimate" if not estimate_differs else "other estimate/SoC") if ESTIMATE.search(name)
                else "other target/cpu" if timing_differs and TIMING.search(name) else "")
        rows.append(MetricRow(name, va, vb, interval(a), interval(b), flag=flag))
    return rows, equal


def _add_paired_intervals(frame: pd.DataFrame, rows: List[MetricRow], run_ids: Sequence[str]) -> str:
    """Each phase's B/A - 1 interval from both runs' per-window log-likelihoods; returns the note saying which."""
    tags = _section(frame, "tags.")
    windows = [t.get("eval_windows_sha256") for t in tags]
    if windows[0] and windows[1] and windows[0] != windows[1]:
        return "No paired interval: the runs' windows hold different tokens (eval_windows_sha256; another tokenizer?)."
    per_window = [window_loglikelihoods(run_id) for run_id in run_ids]
    if any(f is None for f in per_window):
        return "No paired interval: a run has no eval/per_window.csv (logged before it existed, or it failed early)."
    first, second = per_window
    if "window" in first and "window" in second and not first["window"].equals(second["window"]):
        return "No paired interval: the runs' per-window files list different windows."
    tokens = int(frame.at[0, "params.eval.window_len"]) - 1  # position 0 of a window predicts nothing
    by_name = {row.name: row for row in rows}
    paired, skipped = {}, []
    for phase in PHASES:
        column, row = f"ll_{phase}", by_name.get(f"ppl_{phase}")
        if row is None or column not in first or column not in second:
            continue
        a, b = first[column].to_numpy(float), second[column].to_numpy(float)
        if not np.array_equal(np.isfinite(a), np.isfinite(b)):
            skipped.append(row.name)  # a deployed phase on other windows: its ppl covers other tokens than the pair
            continue
        scored = np.isfinite(a)  # a deployed phase may score only the first windows (NaN after them)
        interval = unit_interval(b[scored], a[scored], tokens)
        row.paired = (interval.get("ci_low", np.nan), interval.get("ci_high", np.nan))
        paired[row.name] = int(scored.sum())
    if not paired:
        return "No paired interval: the runs' per-window files share no phase."
    counts = sorted(set(paired.values()), reverse=True)
    over = (f"the {counts[0]} windows" if len(counts) == 1 else "the windows (" + "; ".join(
        f"{', '.join(n for n, c in paired.items() if c == count)}: {count}" for count in counts) + ")")
    note = (f"[low, high] on {', '.join(paired)}: 95% interval of B/A-1, paired bootstrap over {over} both runs "
            "scored (qexp/eval/uncertainty.py); `~`: it spans zero, the difference is within the noise.")
    if skipped:
        note += f" No interval on {', '.join(skipped)}: the runs' deployed phases scored different windows."
    return note


TASK_METRIC = re.compile(r"^task\.(?P<task>[^.]+)\.(?P<metric>\w+?)_(?P<phase>fp|qdq)$")


def _task_items(run_id: str, phase: str) -> Optional[pd.DataFrame]:
    import io

    import mlflow

    try:
        return pd.read_csv(io.StringIO(mlflow.artifacts.load_text(f"runs:/{run_id}/tasks/items_{phase}.csv")))
    except Exception:  # noqa: BLE001 - a run without task items (no eval.tasks, or logged before they existed)
        return None


def _add_task_intervals(frame: pd.DataFrame, rows: List[MetricRow], run_ids: Sequence[str]) -> Optional[str]:
    """Each task metric's B/A - 1 interval from both runs' per-item values (tasks/items_<phase>.csv), paired item by
    item; task metrics of runs that scored different items are flagged instead. Returns the note, if any row."""
    from qexp.eval.uncertainty import paired_ratio_interval

    tags = _section(frame, "tags.")
    paired, differ = [], []
    items = {}
    for row in rows:
        match = TASK_METRIC.match(row.name)
        if match is None or match["metric"].endswith("_stderr"):
            continue
        task, metric, phase = match["task"], match["metric"], match["phase"]
        hashes = [t.get(f"task.{task}.sha256") for t in tags]
        if hashes[0] != hashes[1]:
            row.flag = "NOT COMPARABLE"
            differ.append(task)
            continue
        for i, run_id in enumerate(run_ids):
            if (i, phase) not in items:
                items[(i, phase)] = _task_items(run_id, phase)
        a, b = items[(0, phase)], items[(1, phase)]
        if a is None or b is None or metric not in a or metric not in b:
            continue
        both = a[a["task"] == task].merge(b[b["task"] == task], on=["task", "doc_id"], suffixes=("_a", "_b"))
        va, vb = both[f"{metric}_a"].to_numpy(float), both[f"{metric}_b"].to_numpy(float)
        if metric == "perplexity":  # per-item log-likelihoods: B/A - 1 of exp(-mean)
            interval = unit_interval(vb, va, 1)
        else:
            interval = paired_ratio_interval(vb, va)
        row.paired = (interval.get("ci_low", np.nan), interval.get("ci_high", np.nan))
        paired.append(row.name)
    notes = []
    if paired:
        notes.append(f"[low, high] on the task metrics: 95% interval of B/A-1, paired bootstrap over the items both "
                     f"runs scored ({len(paired)} metrics).")
    if differ:
        notes.append(f"NOT COMPARABLE task metrics ({', '.join(sorted(set(differ)))}): the runs scored different "
                     "items (tag task.<task>.sha256).")
    return " ".join(notes) or None


# ---------------------------------------------------------------- the comparison
def compare_runs(run_a: str, run_b: str, tracking_uri: Optional[str] = None,
                 experiment: Optional[str] = None) -> RunComparison:
    """RUN_A and RUN_B (ids, unique id prefixes, or run names within `experiment`) -> their comparison."""
    client = tracking_client(tracking_uri)
    runs = [resolve_run(client, ref, experiment) for ref in (run_a, run_b)]
    frame = _frame(*runs)
    not_comparable, unknown, unknown_blocks_pairing = _not_comparable(frame)
    timing = _timing_differs(frame)
    rows, equal = _metric_rows(frame, bool(not_comparable), bool(timing))
    params_differ, params_equal = _params(frame)
    notes = []
    if unknown:
        notes.append(f"Comparability not checked for {unknown}: a run did not log it (older run?).")
    if not not_comparable and not unknown_blocks_pairing:
        notes.append(_add_paired_intervals(frame, rows, [run.info.run_id for run in runs]))
    task_note = _add_task_intervals(frame, rows, [run.info.run_id for run in runs])
    if task_note:
        notes.append(task_note)
    return RunComparison(run_summary(client, runs[0]), run_summary(client, runs[1]), params_differ, params_equal, rows,
                         equal, not_comparable, timing, notes)
