"""Comparisons between phases, in one place: Δ perplexity (with its 95% interval), top-1 agreement and logits SQNR
of a test phase against a reference phase on the same windows, and the SQNR of two tensors (the op-level
diagnostics' per-position SQNR is diagnostics/sqnr.py). Every phase's metrics are named `<metric>_<phase>` and every
comparison `<measure>_<test>_vs_<reference>` (e.g. `ppl_qdq_vs_fp`, `top1_agreement_deployed_vs_qdq`)."""

from __future__ import annotations

import math
from typing import Dict

import numpy as np
import torch

from qexp.eval.perplexity import EvalResult
from qexp.eval.uncertainty import ppl_ratio_interval


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `reference`, in dB."""
    noise = (reference.double() - test.double()).pow(2).mean().item()
    signal = reference.double().pow(2).mean().item()
    return float("inf") if noise == 0 else 10 * math.log10(signal / noise)


def top1_agreement(test: EvalResult, reference: EvalResult) -> float:
    """Share of predicted positions where both phases' argmax is the same token."""
    return float((test.top1 == reference.top1).mean())


def phase_metrics(result: EvalResult, phase: str) -> Dict[str, float]:
    """ppl, word_ppl, byte_ppl, bits_per_byte, nll of one phase, suffixed with its name."""
    return {f"{name}_{phase}": value for name, value in result.metrics().items()}


def compare(test: EvalResult, reference: EvalResult, test_name: str, reference_name: str) -> Dict[str, float]:
    """`ppl_<test>_vs_<ref>` (relative: test / reference - 1), top-1 agreement, and the mean logits SQNR over the
    windows whose full logits both kept. Both results must cover the same windows."""
    if test.logprobs.shape != reference.logprobs.shape:
        raise ValueError(f"{test_name} and {reference_name} were scored on different windows "
                         f"({test.logprobs.shape} vs {reference.logprobs.shape})")
    suffix = f"{test_name}_vs_{reference_name}"
    out = {
        f"ppl_{suffix}": test.metrics()["ppl"] / reference.metrics()["ppl"] - 1.0,
        f"top1_agreement_{suffix}": top1_agreement(test, reference),
    }
    # its 95% interval (paired bootstrap: qexp/eval/uncertainty.py): ppl_<suffix>_ci_low / _ci_high / _ci_units
    interval = ppl_ratio_interval(test.logprobs, reference.logprobs)
    out.update({f"ppl_{suffix}_{name}": value for name, value in interval.items()})
    pairs = list(zip(reference.logits, test.logits))
    if pairs:
        out[f"logits_sqnr_db_{suffix}"] = float(np.mean([sqnr_db(a, b) for a, b in pairs]))
    return out
