"""How per-channel 4-bit weights (16a4w, 8a4w) are encoded for HTP: a setting of the HTP backend
(`backend.w4_lowering`) that the QDQ phase also reads, to model HTP's arithmetic with eval.htp_exact even when the run
deploys elsewhere or not at all. A leaf module, so that neither side imports the other."""

from __future__ import annotations

import enum


class W4Lowering(enum.Enum):
    """Same integers and effective scales either way (the QDQ program and the .pte size do not change); the kernels
    differ."""

    lpbq = "lpbq"  # LPBQ with one block per output channel: HTP's block-wise kernels (SM8550/8650/8750: V73+)
    per_channel = "per_channel"  # QNN's per-channel 4-bit encoding: HTP truncates its accumulator (+12% on SmolLM2)


DEFAULT_W4_LOWERING = W4Lowering.lpbq


def htp_exact_lowering(cfg):
    """None for the fake-quant QDQ phase; with eval.htp_exact, how HTP would get per-channel 4-bit weights."""
    return w4_lowering_of(cfg) if cfg.eval.get("htp_exact", False) else None


def w4_lowering_of(cfg) -> str:
    """The run's 4-bit lowering: its backend's setting where it has one (HTP), else the HTP default."""
    return str(getattr(cfg.backend, "w4_lowering", DEFAULT_W4_LOWERING.value)).split(".")[-1]
