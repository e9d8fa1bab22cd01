"""What the MLflow UI shows first: a run's name and one-line description, and the experiment's description.

The runs table cuts names at ~30 characters and has no perplexity column until a user adds one, so the name says
what was run (model · scheme · algorithm · backend, then whatever else a sweep varied) and the description (MLflow's
`mlflow.note.content`, shown on the run page and as a tooltip) says what came of it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from omegaconf import DictConfig

from qexp.core.config import NO_QUANT

NOTE_TAG = "mlflow.note.content"  # the run's / experiment's description in the MLflow UI
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
# A classic model-development experiment: MLflow 3 opens it on the runs table, not on the GenAI trace overview.
EXPERIMENT_KIND = "custom_model_development"

# Overrides the base name already says: the group choices it names (not their settings: a sweep over
# model.masked_softmax must show them; algorithms' settings are in the algorithm's label), and the block size it
# shows as /bN.
_NAMED_BY_BASE = ("model", "quant", "algorithm", "backend", "quant.block_size")
# Overrides that do not change a result, with all their settings.
_NOT_RESULTS = ("experiment", "tracking", "hydra", "cache", "verbose")

EXPERIMENT_DESCRIPTION = """\
**qexp**: one run per experiment config (model · scheme · algorithm · backend), each with its resolved config
(`config.yaml`), log (`run.log`), per-window log-likelihoods (`eval/per_window.csv`) and datasets (evaluation windows,
calibration set).

Metrics that matter:
- `ppl_fp`: the float model (the reference); `ppl_qdq`: the quantized program simulated on the CPU;
  `ppl_deployed`: the compiled `.pte` on its backend (HTP runs on the x86 emulator here: its timings are not phone
  speed).
- `ppl_qdq_vs_fp`, `ppl_deployed_vs_qdq`: relative differences, each with a 95% interval (`*_ci_low`, `*_ci_high`).
  A difference whose interval spans zero is within the noise.
- `ttft_ms`, `prefill_tok_s`, `decode_tok_s`, `pte_bytes`, `peak_rss_mb`, `time_total_s`.

Open with `make ui` (`python -m qexp.ui`): it prints the address of this table in qexp's view (columns and compare
charts). Compare runs only on the same Dataset (text and windows): select runs and open the chart view, or from the
shell `python -m qexp.report --compare RUN_A RUN_B`; tables and plots: `python -m qexp.report --experiment NAME`.
"""


def run_name(cfg: DictConfig, scheme: str, overrides: Sequence[str] = (), varied: Sequence[str] = (),
             transforms: Optional[list] = None) -> str:
    """`smollm2_135m · 16a4w · RTN · htp`, plus the values a sweep job varies beyond those (e.g.
    `observer=moving_average`), so that the runs of one sweep have distinct names; overrides every job of the sweep
    shares are left to the params. `transforms`: cfg.algorithm's, when the caller built them already."""
    algorithm = _algorithm_name(cfg.algorithm, transforms)
    granularity = cfg.quant.weight_granularity
    if getattr(granularity, "name", granularity) == "per_block":  # the block size is what block sweeps vary
        scheme = f"{scheme}/b{cfg.quant.block_size}"
    parts: List[str] = [str(cfg.model.name), scheme, algorithm, str(cfg.backend.name)]
    extras = [o.lstrip("+~") for o in overrides if _key(o) in varied and _key(o) not in _NAMED_BY_BASE
              and not _key(o).startswith("algorithm.") and _key(o).split(".")[0] not in _NOT_RESULTS]
    if not varied and cfg.observer.name != "minmax" and cfg.quant.scheme != NO_QUANT:
        extras.append(f"observer={cfg.observer.name}")  # a single run: the one non-default axis users change most
    return " · ".join(parts + ([" ".join(extras)] if extras else []))


def _algorithm_name(algorithm_cfg, transforms: Optional[list] = None) -> str:
    """`rotation+gptq`, each algorithm with its non-default settings (`weight_clip(objective=outputs)`), as the
    `algorithm` tag; RTN without any. A config that names an unknown algorithm keeps the bare names (validation then
    fails the run with the reason)."""
    if not algorithm_cfg:
        return "RTN"
    from qexp.core.errors import ConfigError
    from qexp.transforms import algorithm_label, build_transforms

    if transforms is not None:
        return algorithm_label(transforms).replace(",", "+")
    try:
        return algorithm_label(build_transforms(algorithm_cfg)).replace(",", "+")  # labels hold no commas
    except ConfigError:
        return "+".join(algorithm_cfg.keys())


def _key(override: str) -> str:
    return override.lstrip("+~").split("=")[0]


def _pct(value: Optional[float]) -> str:
    return f"{value:+.1%}" if value is not None else ""


def run_description(metrics: Dict[str, float], tags: Dict[str, str], backend: str) -> str:
    """The one-line result: `ppl 47.3 (+89.7% vs FP) · HTP 44.2 (x86_emulator) · ~261 tok/s est. SM8650 · 16.2 min`."""
    parts: List[str] = []
    if "ppl_qdq" in metrics:
        parts.append(f"ppl {metrics['ppl_qdq']:.1f} ({_pct(metrics.get('ppl_qdq_vs_fp'))} vs FP)")
    elif "ppl_fp" in metrics:
        parts.append(f"ppl {metrics['ppl_fp']:.1f} (FP)")
    target = tags.get("target", "")
    if "ppl_deployed" in metrics:
        where = f" ({target})" if target else ""
        parts.append(f"{backend.upper()} {metrics['ppl_deployed']:.1f}{where}")
    if "decode_tok_s_est" in metrics:  # a phone's speed for the run's SoC, estimated (qexp/speed)
        parts.append(f"~{metrics['decode_tok_s_est']:.3g} tok/s est. {tags.get('speed_soc', '')}".rstrip()
                     + (" (DDR spills)" if tags.get("ddr_spills") else ""))
    if "decode_tok_s" in metrics:
        parts.append(f"{metrics['decode_tok_s']:.3g} tok/s" + (" emulated" if target == "x86_emulator" else ""))
    if "time_total_s" in metrics:
        parts.append(f"{metrics['time_total_s'] / 60:.1f} min")
    return " · ".join(parts)


def failed_description(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"FAILED: {type(exc).__name__}: {first_line}"[:500]


def sweep_description(name: str, counts: Dict[str, int], experiment: str) -> str:
    summary = ", ".join(f"{count} {status}" for status, count in counts.items())
    return f"sweep {name}: {sum(counts.values())} jobs ({summary}) · table: python -m qexp.report --experiment " \
           f"{experiment} --sweep {name}"
