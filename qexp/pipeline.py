"""The experiment: load -> text/windows -> FP phase -> quantize+calibrate -> QDQ phase -> (backend) -> track.

Each stage lives in its own module; this file only orders them, times them and decides what is logged.
"""

from __future__ import annotations

import functools
import io
import logging
import platform
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from qexp.cache import Cache, stable_hash
from qexp.config import NO_QUANT, BackendKind
from qexp.errors import ConfigError, InputError
from qexp.timing import StageTimer, peak_rss_mb
from qexp.track import REPO_ROOT, Tracker, flatten

if TYPE_CHECKING:
    from qexp.sweep import SweepJob

log = logging.getLogger("qexp")

# Bump when a change makes cached QDQ programs of the same inputs differ.
QDQ_CACHE_VERSION = 1
SQNR_WINDOWS = 2  # windows whose full logits are compared between phases


@dataclass
class ExperimentResult:
    run_id: Optional[str]
    metrics: Dict[str, float] = field(default_factory=dict)
    tags: Dict[str, str] = field(default_factory=dict)
    skipped: bool = False  # a sweep job whose config already had a FINISHED run


# ---------------------------------------------------------------- checks before a run starts
def validate(cfg: DictConfig) -> None:
    from qexp.quantize import validate_recipe
    from qexp.static_model import arch_flags

    arch_flags(cfg.model.arch)
    validate_recipe(cfg.quant, cfg.observer)
    context = cfg.export.max_context_len
    if cfg.eval.seq_len > context:
        raise ConfigError(
            f"eval.seq_len={cfg.eval.seq_len} exceeds the static graph context export.max_context_len={context}",
            "lower eval.seq_len or raise export.max_context_len",
        )
    if cfg.calibration.seq_len > context:
        raise ConfigError(
            f"calibration.seq_len={cfg.calibration.seq_len} exceeds export.max_context_len={context}",
            "lower calibration.seq_len or raise export.max_context_len",
        )
    if cfg.eval.limit < 1:
        raise ConfigError(f"eval.limit={cfg.eval.limit}", "evaluate at least one window")
    if cfg.backend.kind == BackendKind.htp:
        from qexp.deploy import validate_htp

        validate_htp(cfg)
    if cfg.backend.kind == BackendKind.xnnpack:
        from qexp.xnnpack import validate_xnnpack

        validate_xnnpack(cfg)


def config_hash(cfg: DictConfig) -> str:
    """Hash of everything that determines a run's results (not where it is tracked or cached)."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for volatile in ("tracking", "cache_dir"):
        container.pop(volatile, None)
    return stable_hash(container, length=16)


@functools.lru_cache(maxsize=1)
def library_versions() -> Dict[str, str]:
    """Versions that change results (part of cache keys and run tags)."""

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "absent"

    qnn = version("onnxruntime-qnn")
    return {
        "version.torch": version("torch"),
        "version.executorch": version("executorch"),
        "version.torchao": version("torchao"),
        "version.transformers": version("transformers"),
        "version.lm_eval": version("lm_eval"),
        "version.qnn_libs": f"onnxruntime-qnn {qnn}" if qnn != "absent" else "absent",
    }


def qdq_cache_key(cfg: DictConfig, model, static, calibration) -> str:
    """Everything that determines a calibrated QDQ program."""
    return stable_hash({
        "version": QDQ_CACHE_VERSION,
        "model": model.fingerprint,
        "arch": cfg.model.arch,
        "r3": static.r3,
        "recompose_hadamard": cfg.model.recompose_hadamard,
        "context": cfg.export.max_context_len,
        "quant": OmegaConf.to_container(cfg.quant, resolve=True, enum_to_str=True),
        "observer": OmegaConf.to_container(cfg.observer, resolve=True, enum_to_str=True),
        "calibration": calibration.sha256,
        "versions": library_versions(),
    }, length=24)


def environment_tags() -> Dict[str, str]:
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip() or "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", ""
    return {
        "git_commit": commit + ("-dirty" if dirty else ""),
        **library_versions(),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------- the run
def run_experiment(cfg: DictConfig, job: Optional["SweepJob"] = None) -> ExperimentResult:
    """Run one experiment as one MLflow run. As a sweep job (`job`), skip a config that already has a FINISHED
    run in the experiment (unless tracking.force) and record what became of the job for the sweep's summary."""
    tracker = Tracker(cfg.tracking)
    chash = config_hash(cfg)
    if job is not None and not cfg.tracking.force:
        previous = tracker.finished_run(chash)
        if previous is not None:
            log.info("config hash %s already has FINISHED run %s: skipped", chash, previous.info.run_id)
            job.record("skipped", previous.info.run_id, chash)
            return ExperimentResult(previous.info.run_id, dict(previous.data.metrics), {"config_hash": chash},
                                    skipped=True)
    log_buffer = _attach_log_capture()
    tags = {"config_hash": chash, **environment_tags(), "phases": _phases(cfg), **(job.tags() if job else {})}
    run_id = tracker.start(cfg.tracking.run_name or _default_run_name(cfg), tags)
    try:
        Tracker.params(flatten(cfg))
        Tracker.text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        validate(cfg)  # inside the run: a bad config leaves a FAILED run that says why
        result = _run(cfg)
        Tracker.tags(result.tags)
        Tracker.metrics(result.metrics)
        result.run_id = run_id
        Tracker.text(log_buffer.getvalue(), "run.log")
        tracker.finish()
        if job is not None:
            job.record("finished", run_id, chash)
        return result
    except BaseException as exc:
        try:
            Tracker.text(log_buffer.getvalue(), "run.log")
        finally:
            tracker.fail(exc)
        try:  # so the caller (a sweep job) can say which run failed
            exc.run_id, exc.config_hash = run_id, chash
        except AttributeError:
            pass
        raise
    finally:
        _detach_log_capture(log_buffer)


def _phases(cfg: DictConfig) -> str:
    phases = ["fp"] + ([] if cfg.quant.scheme == NO_QUANT else ["qdq"])
    if cfg.backend.kind != BackendKind.none:
        phases.append(cfg.backend.kind.value)
    return ",".join(phases)


def _default_run_name(cfg: DictConfig) -> str:
    return f"{cfg.model.name}-{cfg.quant.name}-{cfg.observer.name}-{cfg.calibration.name}"


def _run(cfg: DictConfig) -> ExperimentResult:
    from qexp.calibration import build_calibration, check_disjoint
    from qexp.evaluate import cached_evaluation, evaluate, make_windows, sqnr_db
    from qexp.load import load_model
    from qexp.quantize import encodings_table, quantize, summarize_encodings, weights_megabytes
    from qexp.static_model import StaticLlama, window_logits
    from qexp.text import load_corpus

    cache = Cache(cfg.cache_dir)
    timer = StageTimer()
    metrics: Dict[str, float] = {}
    tags: Dict[str, str] = {}

    with timer.stage("load"):
        model = load_model(cfg.model, cache)
        if model.max_context and cfg.eval.seq_len > model.max_context:
            raise InputError(
                f"eval.seq_len={cfg.eval.seq_len} is larger than the model's context ({model.max_context} tokens)",
                "lower eval.seq_len",
            )
        static = StaticLlama(model, cfg.export.max_context_len, r3=cfg.model.r3)
    tags.update({"model_sha256": model.fingerprint, "model_source": model.source_path, "r3": str(static.r3)})
    metrics["model_params"] = model.n_params
    metrics["weights_mb"] = weights_megabytes(static.module)  # fp32; the QDQ phase replaces it

    with timer.stage("text"):
        corpus = load_corpus(cfg.text, cache)
        windows = make_windows(corpus.joined("test"), model.tokenizer, cfg.eval.seq_len, cfg.eval.limit, model.add_bos)
    chars = corpus.n_chars
    tags.update({
        "text_source": corpus.source,
        "text_sha256": corpus.sha256,
        "text_comparable_to_wikitext2": str(corpus.comparable_to_wikitext2).lower(),
        "eval_windows_sha256": windows.sha256,
    })
    Tracker.params({
        "eval.text_source": corpus.source,
        "eval.window_len": windows.seq_len,
        "eval.n_windows": windows.n_windows,
        "eval.predicted_tokens": windows.n_predicted,
        "text.test_chars": chars["test"],
        "text.calibration_chars": chars["calibration"],
    })
    _log_array(windows.ids, "eval/windows.npy")

    with timer.stage("eval_fp"):
        # Shared by every run of this model on these windows (a sweep evaluates FP once).
        fp_key = stable_hash({"model": model.fingerprint, "arch": cfg.model.arch, "r3": static.r3,
                              "context": cfg.export.max_context_len, "windows": windows.sha256,
                              "keep_logits": SQNR_WINDOWS, "versions": library_versions()}, length=24)
        fp, fp_hit = cached_evaluation(cache, fp_key, windows, lambda: evaluate(
            lambda ids: window_logits(static.module, static, ids), windows, "FP", keep_logits=SQNR_WINDOWS
        ))
    tags["fp_eval_cache_hit"] = str(fp_hit).lower()
    metrics.update({f"{name}_fp": value for name, value in fp.metrics().items()})
    log.info("FP:  ppl %.3f  word_ppl %.3f  bits/byte %.4f", metrics["ppl_fp"], metrics["word_ppl_fp"],
             metrics["bits_per_byte_fp"])
    per_window = {"window": np.arange(windows.n_windows), "words": windows.words, "bytes": windows.bytes,
                  "ll_fp": fp.logprobs.sum(axis=1)}

    if cfg.quant.scheme != NO_QUANT:
        with timer.stage("calibration_data"):
            calibration = build_calibration(
                cfg.calibration, corpus, model.tokenizer, model.add_bos, cfg.export.max_context_len
            )
            check_disjoint(calibration, windows)
        tags["calibration_sha256"] = calibration.sha256
        metrics["calibration_tokens"] = calibration.n_tokens
        key = qdq_cache_key(cfg, model, static, calibration)
        with timer.stage("quantize"):
            qdq_model = quantize(static, cfg.quant, cfg.observer, calibration, cache, key, timer=timer,
                                 recompose_hadamard=cfg.model.recompose_hadamard)
        tags.update({"qdq_cache_key": key, "qdq_cache_hit": str(qdq_model.cache_hit).lower()})

        with timer.stage("eval_qdq"):
            qdq = evaluate(
                lambda ids: window_logits(qdq_model.module, static, ids), windows, "QDQ", reference=fp,
                keep_logits=SQNR_WINDOWS,
            )
        metrics.update({f"{name}_qdq": value for name, value in qdq.metrics().items()})
        metrics["ppl_qdq_vs_fp"] = metrics["ppl_qdq"] / metrics["ppl_fp"] - 1.0
        metrics["top1_agreement_qdq_vs_fp"] = qdq.extras["top1_agreement"]
        metrics["logits_sqnr_db_qdq"] = float(np.mean([sqnr_db(a, b) for a, b in zip(fp.logits, qdq.logits)]))
        log.info("QDQ: ppl %.3f (%+.2f%% vs FP)  word_ppl %.3f  logits SQNR %.1f dB", metrics["ppl_qdq"],
                 100 * metrics["ppl_qdq_vs_fp"], metrics["word_ppl_qdq"], metrics["logits_sqnr_db_qdq"])
        per_window["ll_qdq"] = qdq.logprobs.sum(axis=1)

        table = encodings_table(qdq_model.module)
        metrics["weights_mb"] = weights_megabytes(static.module, table)
        Tracker.text(table.to_csv(index=False), "quant/encodings.csv")
        Tracker.text(summarize_encodings(table), "quant/summary.txt")

    if cfg.backend.kind == BackendKind.htp:
        from qexp.deploy import run_htp_phase

        htp_metrics, htp_tags = run_htp_phase(
            cfg, model, static, qdq_model, windows, fp, qdq, cache, timer, library_versions()
        )
        metrics.update(htp_metrics)
        tags.update(htp_tags)

    if cfg.backend.kind == BackendKind.xnnpack:
        from qexp.xnnpack import run_xnnpack_phase

        cpu_metrics, cpu_tags = run_xnnpack_phase(cfg, model, windows, fp, cache, timer, library_versions())
        metrics.update(cpu_metrics)
        tags.update(cpu_tags)

    Tracker.text(pd.DataFrame(per_window).to_csv(index=False), "eval/per_window.csv")
    metrics.update(timer.metrics())
    metrics["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return ExperimentResult(run_id=None, metrics=metrics, tags=tags)


def _log_array(array: np.ndarray, artifact_path: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / Path(artifact_path).name
        np.save(local, array)
        Tracker.file(local, str(Path(artifact_path).parent))


# ---------------------------------------------------------------- run.log artifact
def _attach_log_capture() -> io.StringIO:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    handler.set_name("qexp-run-log")
    logger = logging.getLogger("qexp")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    buffer.handler = handler  # type: ignore[attr-defined]
    return buffer


def _detach_log_capture(buffer: io.StringIO) -> None:
    logging.getLogger("qexp").removeHandler(buffer.handler)  # type: ignore[attr-defined]
