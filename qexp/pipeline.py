"""The experiment, as an ordered list of stages:

    load -> text / windows -> calibration data -> FP phase -> transforms -> quantize -> QDQ phase -> tasks -> backend

The calibration data come before the FP phase because building them checks every text a run fits (calibration
samples, QAT's training sequences) against the evaluation windows: a leaking run is refused before any scoring.

Each stage is a function of a `RunState` that reads what earlier stages produced and adds its own; the work itself
lives in the stage's module (qexp/models, data, transforms, quant, eval, backends). `run_experiment` wraps the
stages in one MLflow run; `prepare` runs them up to a stage without tracking (benchmarks and notebooks use it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import pandas as pd
from omegaconf import DictConfig

from qexp.backends import get_backend
from qexp.cache import Cache, check_cache_dir, stable_hash
from qexp.core.config import NO_QUANT, QDQ_ONLY_SCHEMES, check_scheme
from qexp.core.device import device_tags
from qexp.core.errors import ConfigError
from qexp.core.provenance import config_hash, environment_tags, pin_cpu_numerics
from qexp.run_state import ExperimentResult, RunPlan, RunState
from qexp.core.timing import peak_rss_mb
from qexp.tracking.runlog import captured_log
from qexp.tracking.naming import run_description, run_name
from qexp.tracking.record import config_yaml, flatten
from qexp.tracking.store import Tracker

if TYPE_CHECKING:
    from qexp.tracking.sweep import SweepJob

log = logging.getLogger("qexp")

STAGES = ("load", "text", "calibration", "fp", "transform", "qdq", "tasks", "deploy")


# ---------------------------------------------------------------- checks before a run starts
def _check_run_settings(cfg: DictConfig) -> None:
    """The run's plain settings (scheme name, windows, context, cache), which need no model, upstream code or
    algorithm."""
    if cfg.quant.scheme != NO_QUANT:
        check_scheme(cfg.quant.scheme)
    context = cfg.export.max_context_len
    for key, value in (("eval.seq_len", cfg.eval.seq_len), ("calibration.seq_len", cfg.calibration.seq_len)):
        if value > context:
            raise ConfigError(f"{key}={value} exceeds the static graph context export.max_context_len={context}",
                              f"lower {key} or raise export.max_context_len")
    if cfg.eval.limit != "all" and not (isinstance(cfg.eval.limit, int) and cfg.eval.limit >= 1):
        raise ConfigError(f"eval.limit={cfg.eval.limit}", "evaluate at least one window, or eval.limit=all")
    if cfg.cache.max_gb is not None and cfg.cache.max_gb <= 0:
        raise ConfigError(f"cache.max_gb={cfg.cache.max_gb}", "use a positive size in GiB, or null for no bound")
    if cfg.cache.lock_timeout_s is not None and cfg.cache.lock_timeout_s <= 0:
        raise ConfigError(f"cache.lock_timeout_s={cfg.cache.lock_timeout_s}",
                          "use a positive number of seconds, or null to wait as long as the building job lives")
    check_cache_dir(cfg.cache_dir)


def validate(cfg: DictConfig, transforms: Optional[List[Any]] = None) -> RunPlan:
    """Reject a bad config before any model is loaded; returns the run's backend and algorithms (`transforms`: those
    already built from cfg.algorithm, checked here rather than built again)."""
    from qexp.core.device import check_device
    from qexp.models.shapes import check_gpu_memory

    check_device(cfg.get("device", "cpu"))  # first: device=cuda on a host without one is one line, before any work
    check_gpu_memory(cfg)  # a GPU too small for the model: one line, before it loads
    backend = get_backend(cfg.backend.name)
    _check_run_settings(cfg)  # before the checks that import ExecuTorch (~6 s): a typo is refused in seconds

    from qexp.data.text import check_texts
    from qexp.models.shapes import linear_shapes
    from qexp.models.static_llama import arch_flags
    from qexp.quant.recipe import check_block_sizes, check_overrides_match, uses_blocks, validate_recipe
    from qexp.transforms import validate_transforms

    arch_flags(cfg.model.arch)
    validate_recipe(cfg.quant, cfg.observer)
    if uses_blocks(cfg.quant) or cfg.quant.overrides:  # from the model's metadata; the load stage checks again
        shapes = linear_shapes(cfg.model)
        if shapes:
            check_block_sizes(cfg.quant, shapes)
            check_overrides_match(cfg.quant, shapes)
    if cfg.quant.scheme in QDQ_ONLY_SCHEMES and backend.deploys:
        raise ConfigError(f"quant={cfg.quant.scheme} is a QDQ-only research scheme: backend={cfg.backend.name} has no "
                          "3-bit weights (HTP runs 4, 8 and 16-bit weights)", "use backend=none, or a 4-bit scheme")
    if str(cfg.quant.get("weight_range", "narrow")).endswith("full"):
        if backend.deploys:
            raise ConfigError(f"quant.weight_range=full is a QDQ-only ablation: backend={cfg.backend.name} is not "
                              "verified with [-8, 7] 4-bit weights", "use backend=none, or weight_range=narrow")
        if cfg.algorithm:
            raise ConfigError("quant.weight_range=full with an algorithm: the algorithms search the [-7, 7] grid",
                              "use algorithm=[] (round to nearest), or weight_range=narrow")
    transforms = validate_transforms(cfg, transforms)
    needs_calibration = cfg.quant.scheme != NO_QUANT or any(t.needs_calibration for t in transforms)
    if needs_calibration and cfg.calibration.limit < 1:
        raise ConfigError(f"calibration.limit={cfg.calibration.limit}: calibration data is empty",
                          "use calibration.limit>=1")
    check_texts(cfg.text, cfg.calibration, needs_calibration)  # e.g. text=austen without its Debian package
    if any(cfg.eval.get(k) for k in ("tasks", "task_paths", "deployed_task_limit", "generation_check")):
        from qexp.tasks.harness import check_tasks

        check_tasks(cfg)
    backend.validate(cfg)
    return RunPlan(backend, transforms)


def algorithms(cfg: DictConfig) -> List[Any]:
    """cfg.algorithm's transforms, in order (unvalidated: validate() checks them against the whole config)."""
    from qexp.transforms import build_transforms

    return build_transforms(cfg.algorithm)


def _built_transforms(cfg: DictConfig) -> Optional[List[Any]]:
    """cfg.algorithm's transforms for the run's name and its checks; None when they cannot be built (the check
    inside the run then fails it with the reason)."""
    try:
        return algorithms(cfg)
    except ConfigError:
        return None


# ---------------------------------------------------------------- the run
def run_experiment(cfg: DictConfig, job: Optional["SweepJob"] = None) -> ExperimentResult:
    """Run one experiment as one MLflow run. As a sweep job (`job`), skip a config that already has a FINISHED
    run in the experiment (unless tracking.force) and record what became of the job for the sweep's summary."""
    tracker = Tracker(cfg.tracking, patient=job is not None)  # a sweep's job waits out an outage of its store
    chash = config_hash(cfg)
    if job is None:
        return _tracked_run(cfg, tracker, chash, job)
    check_cache_dir(cfg.cache_dir)  # the claim below lives there
    # Two sweeps started together may both hold this config: the first takes it, the second waits and then finds
    # its FINISHED run (a machine-wide lock per store, experiment and config; another host may still duplicate it).
    lock_key = stable_hash([tracker.uri, cfg.tracking.experiment, chash], length=24)
    with Cache(cfg.cache_dir, cfg.cache.lock_timeout_s).lock("run_claims", lock_key):
        if not cfg.tracking.force:
            previous = tracker.finished_run(chash)
            if previous is not None and not _still_valid(cfg):
                # finished before a check that now refuses it (a garbage HTP program, say): not a result to resume
                # from; the run below fails again inside a tracked run that says why
                log.info("config hash %s has FINISHED run %s, but its config is refused now: not skipped", chash,
                         previous.info.run_id)
                previous = None
            if previous is not None and not _same_htp_exact_model(cfg, previous):
                # an eval.htp_exact run computed by an older model of HTP's arithmetic: its QDQ numbers are not this
                # code's, so it is not a result to resume from
                log.info("config hash %s has FINISHED run %s with an older htp_exact model (%s): not skipped", chash,
                         previous.info.run_id, previous.data.tags.get("htp_exact_model", "conv_accumulator_floor"))
                previous = None
            if previous is not None:
                log.info("config hash %s already has FINISHED run %s: skipped", chash, previous.info.run_id)
                job.record("skipped", previous.info.run_id, chash)
                return ExperimentResult(previous.info.run_id, dict(previous.data.metrics), {"config_hash": chash},
                                        skipped=True)
        return _tracked_run(cfg, tracker, chash, job)


def _same_htp_exact_model(cfg: DictConfig, previous) -> bool:
    """Whether a FINISHED run's QDQ phase used this code's model of HTP's arithmetic (always, without htp_exact)."""
    from qexp.quant.htp_arithmetic_pass import MODELLED_OPS

    if not cfg.eval.get("htp_exact", False) or previous.data.tags.get("qdq_arithmetic") != "htp_exact":
        return True
    return previous.data.tags.get("htp_exact_model") == MODELLED_OPS


def _still_valid(cfg: DictConfig) -> bool:
    from qexp.core.errors import QexpError

    try:
        validate(cfg)
    except QexpError:
        return False
    return True


def _tracked_run(cfg: DictConfig, tracker: Tracker, chash: str, job: Optional["SweepJob"]) -> ExperimentResult:
    with captured_log(verbose=bool(cfg.verbose)) as run_log:
        tags = {"config_hash": chash, **environment_tags(), **(job.tags() if job else _named_sweep_tags(cfg))}
        transforms = _built_transforms(cfg)
        name = cfg.tracking.run_name or _default_run_name(cfg, job, transforms)
        run_id = tracker.start(name, tags)
        try:
            # "algorithm" as one param too (the config logs each algorithm's settings), for the UI's compare charts
            Tracker.params({**flatten(cfg), "algorithm": ",".join(cfg.algorithm.keys()) or "RTN"})
            Tracker.text(config_yaml(cfg), "config.yaml")
            plan = validate(cfg, transforms)  # inside the run: a bad config leaves a FAILED run that says why
            state = RunState(cfg, plan.backend, plan.transforms, tracked=True)
            state.cache.run_id = run_id  # each cache entry records the runs that used it
            Tracker.tags({"phases": _phases(state), "scheme": plan.backend.scheme(cfg)})
            result = execute(state)
            Tracker.tags(result.tags)
            Tracker.metrics(result.metrics)
            result.run_id, result.name = run_id, name
            result.description = run_description(result.metrics, result.tags, cfg.backend.name)
            Tracker.describe(result.description)
            tracker.end(run_log.getvalue())
        except BaseException as exc:
            tracker.end(run_log.getvalue(), exc)
            try:  # so the caller (a sweep job) can say which run failed
                exc.run_id, exc.config_hash = run_id, chash
            except AttributeError:
                pass
            raise
    if cfg.cache.max_gb is not None:
        from qexp.cache.usage import prune

        prune(state.cache.root, max_bytes=int(cfg.cache.max_gb * 2**30), keep_run=run_id)
    if job is not None:
        job.record("finished", run_id, chash)
    return result


def _phases(state: RunState) -> str:
    phases = ["fp"] + (["qdq"] if state.quantized else [])
    return ",".join(phases + ([state.cfg.backend.name] if state.backend.deploys else []))


def _named_sweep_tags(cfg: DictConfig) -> Dict[str, str]:
    """A single run given `tracking.sweep` belongs to that sweep too, so `qexp.report --sweep NAME` finds it (a run
    added to a sweep's table later, e.g. one deployed configuration)."""
    from qexp.tracking.sweep import SWEEP_TAG

    return {SWEEP_TAG: str(cfg.tracking.sweep)} if cfg.tracking.sweep else {}


def _default_run_name(cfg: DictConfig, job: Optional["SweepJob"], transforms: Optional[List[Any]]) -> str:
    try:
        scheme = get_backend(cfg.backend.name).scheme(cfg)
    except Exception:  # noqa: BLE001 - an unknown backend fails validation inside the run, which needs a name first
        scheme = str(cfg.quant.name)
    if job:
        return run_name(cfg, scheme, job.overrides, job.varied, transforms=transforms)
    return run_name(cfg, scheme, transforms=transforms)


def execute(state: RunState) -> ExperimentResult:
    """Every stage in order -> the run's metrics and tags."""
    from qexp.stages import STAGE_FUNCTIONS

    state.tags.update({**pin_cpu_numerics(), **device_tags(state.device)})
    for name in STAGES:
        STAGE_FUNCTIONS[name](state)
    state.log_text(pd.DataFrame(state.per_window).to_csv(index=False), "eval/per_window.csv")
    state.metrics.update(state.timer.metrics())
    state.metrics["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return ExperimentResult(run_id=None, metrics=state.metrics, tags=state.tags)


def prepare(cfg: DictConfig, through: str = "qdq") -> RunState:
    """Run the stages up to and including `through` (one of STAGES), untracked: a public entry point for benchmarks
    and notebooks that need a run's intermediate objects (windows, FP result, QDQ program, ...). Stop at "qdq" to keep
    the float programs: the deploy stage frees them (QdqPhase.release_programs) before the backend compiles."""
    from qexp.stages import STAGE_FUNCTIONS

    if through not in STAGES:
        raise ValueError(f"unknown stage {through!r}; stages: {', '.join(STAGES)}")
    plan = validate(cfg)
    state = RunState(cfg, plan.backend, plan.transforms)
    state.tags.update({**pin_cpu_numerics(), **device_tags(state.device)})
    for name in STAGES[: STAGES.index(through) + 1]:
        STAGE_FUNCTIONS[name](state)
    return state
