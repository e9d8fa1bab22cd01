"""Per-position SQNR: the op-level diagnostics' score (diag_htp_ops.py, diag_htp_norm.py, diag_qdq_perturb.py)."""

from __future__ import annotations

import math

import torch


def position_sqnrs_db(reference: torch.Tensor, test: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each token position's SQNR (dB) of `test` against `reference`, over the positions with signal (inf where
    equal); the token axis is the first of length `tokens` (none: one value, the whole tensor's)."""
    reference, test = reference.double(), test.double()
    axes = [i for i, n in enumerate(reference.shape) if n == tokens]
    if axes:
        reference = reference.movedim(axes[0], 0).reshape(tokens, -1)
        test = test.movedim(axes[0], 0).reshape(tokens, -1)
    else:
        reference, test = reference.reshape(1, -1), test.reshape(1, -1)
    signal, noise = reference.pow(2).sum(1), (reference - test).pow(2).sum(1)
    keep = signal > 0  # a position with nothing in it has no ratio
    return torch.where(noise[keep] == 0, torch.tensor(math.inf, dtype=torch.float64),
                       10 * torch.log10(signal[keep] / noise[keep].clamp_min(1e-300)))


def per_position_sqnr_db(reference: torch.Tensor, test: torch.Tensor, tokens: int) -> float:
    """The median over token positions of each position's SQNR (dB) of `test` against `reference`
    (position_sqnrs_db).

    Why per position: SmolLM2's and Gemma's residual streams carry massive activations at the first position (Gemma
    3's ~300x the others' rms), so a whole-tensor SQNR is that position's; a norm then rescales every position to the
    same rms and its whole-tensor SQNR falls by 15-30 dB with no error of its own (Gemma-3-270M's pre-norms alone on
    HTP are 67-72 dB from their QDQ programs on real inputs: diagnostics/diag_htp_norm.py). The op-level
    diagnostics (diagnostics/diag_htp_ops.py, diag_htp_norm.py, diag_qdq_perturb.py) score with it."""
    db = position_sqnrs_db(reference, test, tokens)
    if db.numel() == 0:  # no position has signal
        return math.inf if torch.equal(reference.double(), test.double()) else -math.inf
    return float(db.median())
