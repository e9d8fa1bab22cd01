"""95% confidence intervals for a perplexity ratio between two phases scored on the same tokens: a paired bootstrap.

The resampling unit is the evaluation window when there are at least MIN_WINDOWS of them: windows are disjoint
stretches of text, while the tokens inside one share their context and are correlated, so resampling tokens would
give intervals that are too narrow. A phase scored on fewer windows (the HTP phase scores one 255-token window
here) is resampled in blocks of BLOCK consecutive tokens instead; blocks of one window are still correlated, so
those intervals are narrower than the truth, and the metric `<name>_ci_units` (how many units were resampled) says
which it was: it equals the window count when windows were the unit.

Paired: each resample draws the same units for both phases, so what they share (hard text) cancels and only their
difference varies. Percentile interval, seeded (SEED), RESAMPLES draws.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

MIN_WINDOWS = 8
BLOCK = 32  # tokens
RESAMPLES = 2000
SEED = 0


def resampling_units(test_lp: np.ndarray, reference_lp: np.ndarray) -> Tuple[np.ndarray, np.ndarray, int]:
    """Per-unit sums of log-likelihood (test, reference) and the tokens per unit."""
    n_windows, n_tokens = test_lp.shape
    if n_windows >= MIN_WINDOWS or n_tokens < 2 * BLOCK:
        return test_lp.sum(axis=1), reference_lp.sum(axis=1), n_tokens
    usable = (n_tokens // BLOCK) * BLOCK  # the tail shorter than a block is left out of the interval only
    blocks = lambda lp: lp[:, :usable].reshape(n_windows * (usable // BLOCK), BLOCK).sum(axis=1)  # noqa: E731
    return blocks(test_lp), blocks(reference_lp), BLOCK


def ppl_ratio_interval(test_lp: np.ndarray, reference_lp: np.ndarray) -> Dict[str, float]:
    """{ci_low, ci_high, ci_units} of ppl(test) / ppl(reference) - 1 (both [windows, tokens] log-likelihoods)."""
    return unit_interval(*resampling_units(test_lp, reference_lp))


def unit_interval(test_units: np.ndarray, reference_units: np.ndarray, per_unit: int) -> Dict[str, float]:
    """The interval from per-unit log-likelihood sums (each unit holds `per_unit` tokens)."""
    n = len(test_units)
    if n < 2:
        return {"ci_units": float(n)}
    draws = np.random.default_rng(SEED).integers(0, n, size=(RESAMPLES, n))
    # ppl_t / ppl_r = exp((sum ll_r - sum ll_t) / tokens); every draw has n * per_unit tokens
    ratios = np.expm1((reference_units[draws].sum(axis=1) - test_units[draws].sum(axis=1)) / (n * per_unit))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return {"ci_low": float(low), "ci_high": float(high), "ci_units": float(n)}


def windows_needed(test_window_ll: np.ndarray, reference_window_ll: np.ndarray, tokens_per_window: int,
                   resolve: float) -> int:
    """How many windows like these make the 95% interval of the ppl ratio no wider than +-`resolve` (e.g. 0.01 for
    1%), from per-window log-likelihood sums: the half-width shrinks as 1/sqrt(windows). -1 if under 2 windows."""
    interval = unit_interval(np.asarray(test_window_ll), np.asarray(reference_window_ll), tokens_per_window)
    if "ci_low" not in interval:
        return -1
    half_width = (interval["ci_high"] - interval["ci_low"]) / 2
    return max(1, int(np.ceil(interval["ci_units"] * (half_width / resolve) ** 2)))


def paired_mean_interval(test: np.ndarray, reference: np.ndarray) -> Dict[str, float]:
    """{ci_low, ci_high, ci_units} of mean(test - reference) over paired items (e.g. per-item task accuracies of two
    phases): the same seeded percentile bootstrap, items as the unit."""
    diff = np.asarray(test, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    n = len(diff)
    if n < 2:
        return {"ci_units": float(n)}
    draws = np.random.default_rng(SEED).integers(0, n, size=(RESAMPLES, n))
    low, high = np.percentile(diff[draws].mean(axis=1), [2.5, 97.5])
    return {"ci_low": float(low), "ci_high": float(high), "ci_units": float(n)}


def paired_ratio_interval(test: np.ndarray, reference: np.ndarray) -> Dict[str, float]:
    """{ci_low, ci_high, ci_units} of mean(test) / mean(reference) - 1 over paired items (e.g. one task's accuracy in
    two runs): the same seeded percentile bootstrap, items as the unit."""
    test, reference = np.asarray(test, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    n = len(test)
    if n < 2:
        return {"ci_units": float(n)}
    draws = np.random.default_rng(SEED).integers(0, n, size=(RESAMPLES, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = test[draws].mean(axis=1) / reference[draws].mean(axis=1) - 1
    low, high = np.percentile(ratios[np.isfinite(ratios)], [2.5, 97.5]) if np.isfinite(ratios).any() else (np.nan,) * 2
    return {"ci_low": float(low), "ci_high": float(high), "ci_units": float(n)}
