"""lm-eval tasks on a run's phases: which tasks (qexp's offline tasks, a user's task folders, lm-eval's own), checked
before any heavy work, scored with lm-eval's `simple_evaluate`, and read back as metrics, per-item tables and paired
comparisons between phases."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from qexp.core.errors import ConfigError
from qexp.tasks.offline import KINDS, TEXTS, parse_task_name


BOOTSTRAP_ITERS = 1000  # lm-eval's stderr of non-mean aggregations (perplexity); its default 100,000 takes minutes
DEPLOYED_TASK_BACKENDS = ("xnnpack", "htp")  # their phases give a task scorer (PhaseResult.task_scorer)


# ---------------------------------------------------------------- checks before a run starts
def check_tasks(cfg) -> None:
    """Every name in eval.tasks must be a qexp task, a task of eval.task_paths or one of lm-eval's, and every YAML in
    eval.task_paths must parse: one line each, before any model is loaded."""
    _check_generation(cfg)
    names = list(cfg.eval.get("tasks") or [])
    paths = list(cfg.eval.get("task_paths") or [])
    deployed = cfg.eval.get("deployed_task_limit") or 0
    if not isinstance(deployed, int) or deployed < 0:
        raise ConfigError(f"eval.deployed_task_limit={deployed}", "use 0 (none) or a positive number of items per task")
    if not names:
        if paths:
            raise ConfigError("eval.task_paths without eval.tasks", "name the tasks to run: eval.tasks=[...]")
        if deployed:
            raise ConfigError("eval.deployed_task_limit without eval.tasks", "name the tasks to run: eval.tasks=[...]")
        return
    if deployed and cfg.backend.name not in DEPLOYED_TASK_BACKENDS:
        raise ConfigError(f"eval.deployed_task_limit={deployed}: backend={cfg.backend.name} has no deployed program "
                          "that scores tasks", f"use backend={' or backend='.join(DEPLOYED_TASK_BACKENDS)}, or "
                          "eval.deployed_task_limit=0")
    if deployed and str(getattr(cfg.backend.get("target"), "value", cfg.backend.get("target"))) == "android":
        raise ConfigError(f"eval.deployed_task_limit={deployed}: the program on a phone scores perplexity windows only",
                          "score tasks on the emulator (backend.target=x86_emulator), or eval.deployed_task_limit=0")
    limit = cfg.eval.get("task_limit")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"eval.task_limit={limit}", "use a positive number of items per task, or null for all")
    for path in paths:
        _check_task_folder(path)
    for name in names:
        parsed = parse_task_name(name)
        if parsed and parsed[1] == "austen":
            from qexp.data.text_sources import AUSTEN_PACKAGE, austen_path

            if austen_path() is None:
                raise ConfigError(f"eval.tasks: {name} is built from Austen's novels, which need {AUSTEN_PACKAGE}")
    ours = [f"qexp_{k}_{t}" for k in KINDS for t in TEXTS]
    for name in names:
        if name.startswith("qexp_") and parse_task_name(name) is None:  # qexp's namespace: no lm-eval index needed
            close = difflib.get_close_matches(name, ours, n=1)
            raise ConfigError(f"eval.tasks: unknown task {name!r} (qexp's tasks: {', '.join(ours)})"
                              + (f"; did you mean {close[0]}?" if close else ""), "use one of qexp's task names")
    others = [n for n in names if parse_task_name(n) is None]
    if not others:
        return
    from lm_eval.tasks import TaskManager

    found = set(TaskManager(include_path=paths, include_defaults=False).all_tasks) if paths else set()
    missing = [n for n in others if n not in found]
    if missing:
        known = TaskManager(include_path=paths or None).all_tasks  # lm-eval's own index: ~15 s
        unknown = [n for n in missing if n not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], ours + list(known), n=3)
            raise ConfigError(
                f"eval.tasks: unknown task {unknown[0]!r} (not one of qexp's {', '.join(ours)}, none of lm-eval's "
                f"{len(known)} tasks, none in eval.task_paths)" + (f"; did you mean {', '.join(close)}?" if close
                                                                    else ""),
                "list lm-eval's tasks with `lm_eval ls tasks`; a local task needs its folder in eval.task_paths")


def _check_generation(cfg) -> None:
    from qexp.tasks.generation import PROMPT_TOKENS

    n, n_new = cfg.eval.get("generation_check") or 0, cfg.eval.get("generation_tokens")
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"eval.generation_check={n}", "use 0 (none) or a number of prompts")
    if not n:
        return
    windows = cfg.eval.limit
    if windows != "all" and n > windows:
        raise ConfigError(f"eval.generation_check={n}: the prompts are the first tokens of the evaluation windows, "
                          f"and eval.limit={windows}", f"raise eval.limit to {n} or ask for fewer prompts")
    if not isinstance(n_new, int) or n_new < 1 or PROMPT_TOKENS + n_new > cfg.eval.seq_len:
        raise ConfigError(f"eval.generation_tokens={n_new}", f"use 1..{cfg.eval.seq_len - PROMPT_TOKENS} (a prompt of "
                          f"{PROMPT_TOKENS} tokens and its continuation fit in eval.seq_len={cfg.eval.seq_len})")


def _check_task_folder(path: str) -> None:
    from lm_eval.tasks._yaml_loader import load_yaml

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"eval.task_paths: {path} is not a folder", "pass folders of lm-eval task YAML files")
    yamls = sorted(folder.rglob("*.yaml"))
    if not yamls:
        raise ConfigError(f"eval.task_paths: {path} has no .yaml task file", "pass a folder of lm-eval task YAMLs")
    for yaml_path in yamls:
        try:
            load_yaml(yaml_path, resolve_func=False, recursive=False)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file: say which and why
            first = " ".join(str(exc).split())[:200]
            raise ConfigError(f"eval.task_paths: {yaml_path} does not parse ({type(exc).__name__}: {first})",
                              "fix the YAML (lm-eval's task format)") from exc


# ---------------------------------------------------------------- scoring
@dataclass
class TaskResult:
    """One phase on the tasks: lm-eval's aggregate metrics and every item's per-item values."""

    phase: str
    metrics: Dict[str, Dict[str, float]]  # task -> {metric: value, metric_stderr: value}
    items: pd.DataFrame  # task, doc_id, <metric> columns (acc 0/1, a perplexity item's log-likelihood)
    n_items: Dict[str, int] = field(default_factory=dict)

    def logged(self) -> Dict[str, float]:
        """MLflow metrics `task.<task>.<metric>_<phase>` (and `..._stderr_<phase>`, `task.<task>.items`)."""
        out = {}
        for task, values in self.metrics.items():
            for metric, value in values.items():
                out[f"task.{task}.{metric}_{self.phase}"] = value
            out[f"task.{task}.items"] = float(self.n_items.get(task, 0))
        return out


def evaluate_tasks(lm, names: List[str], include_paths: List[str], limit: Optional[int], phase: str) -> TaskResult:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # lm-eval's own index only when a name needs it (~15 s)
    local = set(TaskManager(include_path=include_paths, include_defaults=False).all_tasks) if include_paths else set()
    needs_defaults = any(parse_task_name(n) is None and n not in local for n in names)
    manager = TaskManager(include_path=include_paths or None, include_defaults=needs_defaults)
    out = simple_evaluate(model=lm, tasks=list(names), task_manager=manager, limit=limit, log_samples=True,
                          bootstrap_iters=BOOTSTRAP_ITERS)
    return _read_results(out, phase)


def _read_results(out: dict, phase: str) -> TaskResult:
    metrics: Dict[str, Dict[str, float]] = {}
    for task, values in out["results"].items():
        row = {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, _filter = key.split(",", 1)
            row[metric] = float(value)
        metrics[task] = row
    frames, counts = [], {}
    for task, samples in out.get("samples", {}).items():
        rows = []
        for sample in samples:
            row = {"task": task, "doc_id": int(sample["doc_id"])}
            for metric in metrics.get(task, {}):
                if metric.endswith("_stderr") or metric not in sample:
                    continue
                value = sample[metric]
                row[metric] = float(value[0] if isinstance(value, (list, tuple)) else value)
            rows.append(row)
        counts[task] = len(rows)
        frames.append(pd.DataFrame(rows))
    items = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["task", "doc_id"])
    return TaskResult(phase, metrics, items, counts)


# ---------------------------------------------------------------- comparisons
def paired_task_deltas(test: TaskResult, reference: TaskResult) -> Dict[str, float]:
    """Per task and metric, the test phase minus the reference on the same items, with a paired 95% interval:
    `task.<task>.<metric>_<test>_vs_<reference>` (+ `_ci_low`, `_ci_high`). Accuracies: the difference in points
    (fraction); perplexity: the ratio - 1, as the perplexity deltas of the windows."""
    from qexp.eval.uncertainty import paired_mean_interval, unit_interval

    out: Dict[str, float] = {}
    merged = test.items.merge(reference.items, on=["task", "doc_id"], suffixes=("_t", "_r"))
    for task, rows in merged.groupby("task"):
        for metric in test.metrics.get(task, {}):
            if f"{metric}_t" not in rows or metric.endswith("_stderr"):
                continue
            t, r = rows[f"{metric}_t"].to_numpy(float), rows[f"{metric}_r"].to_numpy(float)
            name = f"task.{task}.{metric}_{test.phase}_vs_{reference.phase}"
            if metric == "perplexity":  # per-item log-likelihoods: the aggregate's ratio
                out[name] = float(np.expm1((r.sum() - t.sum()) / len(t)))
                interval = unit_interval(t, r, 1)
            else:
                out[name] = float(np.mean(t - r))
                interval = paired_mean_interval(t, r)
            out.update({f"{name}_{k}": v for k, v in interval.items() if k != "ci_units"})
    return out


def cached_task_result(cache, key: str, phase: str, compute) -> tuple:
    """`compute()` once per key (the FP phase of one model on one task suite is shared by every run that asks for
    it); stored losslessly (per-item values as float64 in a CSV with full precision), so hit and miss agree."""
    import json

    def build(tmp):
        result = compute()
        result.items.to_csv(tmp / "items.csv", index=False, float_format="%.17g")
        (tmp / "metrics.json").write_text(json.dumps({"metrics": result.metrics, "n_items": result.n_items}))

    path, hit = cache.get_or_build("task_eval", key, build)
    stored = json.loads((path / "metrics.json").read_text())
    return TaskResult(phase, stored["metrics"], pd.read_csv(path / "items.csv"), stored["n_items"]), hit
