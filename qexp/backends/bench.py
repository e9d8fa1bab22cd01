"""The speed bench every backend that runs for real shares: TTFT, prefill and decode rates over repeated generations,
measured (the phone-speed estimate is qexp/speed/).

A backend supplies `generate() -> Generation`, timed with `time.perf_counter` around its own calls (sub-millisecond;
runner stats in whole milliseconds are too coarse for a 135M model on CPU). Warm-up generations are discarded; the
repeats give medians and tails: p90 of latencies, p10 of rates (the slow tail of a rate is its low end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import numpy as np


@dataclass
class Generation:
    tokens: List[int]
    ttft_s: float  # prompt in -> first new token out
    prefill_s: float  # the prompt's forward pass(es)
    decode_s: float  # the remaining n_new - 1 tokens
    n_prompt: int
    extras: Dict[str, float] = field(default_factory=dict)  # backend-specific per-run figures, last run logged

    @property
    def n_decoded(self) -> int:
        return len(self.tokens) - 1


def measure(generate: Callable[[], Generation], warmup: int, repeats: int) -> Tuple[Dict[str, float], Generation]:
    """Run `warmup` discarded generations then `repeats` timed ones; return (metrics, the last generation)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} (>= 1) and warmup={warmup} (>= 0) required")
    for _ in range(warmup):
        generate()
    runs = [generate() for _ in range(repeats)]
    return summarize(runs), runs[-1]


def summarize(runs: List[Generation]) -> Dict[str, float]:
    ttft_ms = np.array([r.ttft_s for r in runs]) * 1000
    prefill = np.array([r.n_prompt / r.prefill_s for r in runs])
    decoded = [r for r in runs if r.n_decoded > 0 and r.decode_s > 0]
    decode = np.array([r.n_decoded / r.decode_s for r in decoded]) if decoded else np.array([np.nan])
    per_token_ms = np.array([1000 * r.decode_s / r.n_decoded for r in decoded]) if decoded else np.array([np.nan])
    return {
        "ttft_ms": float(np.median(ttft_ms)),
        "ttft_ms_p90": float(np.percentile(ttft_ms, 90)),
        "prefill_tok_s": float(np.median(prefill)),
        "prefill_tok_s_p10": float(np.percentile(prefill, 10)),
        "decode_tok_s": float(np.median(decode)),
        "decode_tok_s_p10": float(np.percentile(decode, 10)),
        "decode_ms_per_token": float(np.median(per_token_ms)),
        "decode_ms_per_token_p90": float(np.percentile(per_token_ms, 90)),
        "speed_repeats": float(len(runs)),
        **runs[-1].extras,
    }
