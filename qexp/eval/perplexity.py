"""Evaluate stage: the windows (qexp/data/windows.py) through any phase's model, and perplexity metrics over them.

Token perplexity is over the predicted positions; word and byte perplexity and bits per byte use lm-eval's own
aggregation functions (`weighted_perplexity`, `bits_per_byte`) and its word/byte counting, applied to the text each
window predicts. Comparisons between phases are in qexp/eval/compare.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from qexp.data.windows import Windows

log = logging.getLogger("qexp")

LogitsFn = Callable[[np.ndarray], torch.Tensor]  # window token ids [T] -> logits [T, vocab]


@dataclass
class EvalResult:
    """Per-position log-likelihoods of one phase; metrics on all windows or a subset."""

    logprobs: np.ndarray  # float64 [n_windows, seq_len - first_target]
    windows: Windows
    top1: np.ndarray  # int64 [n_windows, seq_len - first_target]: argmax predictions (for agreement)
    logits: List[torch.Tensor] = field(default_factory=list)  # full logits of the first `keep_logits` windows

    def head(self, windows: Windows) -> "EvalResult":
        """This result restricted to a `Windows.head` subset (causal: the first positions do not see the rest)."""
        n = windows.seq_len - windows.first_target
        return EvalResult(
            logprobs=self.logprobs[: windows.n_windows, :n], windows=windows, top1=self.top1[: windows.n_windows, :n]
        )

    def metrics(self, rows: Optional[np.ndarray] = None) -> Dict[str, float]:
        from lm_eval.api.metrics import bits_per_byte

        rows = np.arange(self.windows.n_windows) if rows is None else rows
        window_ll = self.logprobs[rows].sum(axis=1)
        n_tokens = self.logprobs.shape[1]
        token_items = [(float(ll), n_tokens) for ll in window_ll]
        word_items = [(float(ll), int(w)) for ll, w in zip(window_ll, self.windows.words[rows])]
        byte_items = [(float(ll), int(b)) for ll, b in zip(window_ll, self.windows.bytes[rows])]
        return {
            "ppl": weighted_perplexity(token_items),
            "word_ppl": weighted_perplexity(word_items),
            "byte_ppl": weighted_perplexity(byte_items),
            "bits_per_byte": bits_per_byte(byte_items),
            "nll": -float(window_ll.sum()) / (len(rows) * n_tokens),
        }


def weighted_perplexity(items) -> float:
    """lm-eval's `weighted_perplexity`, except that a collapsed model (exp of the mean NLL beyond float range, e.g.
    word perplexity of a random model) gives inf instead of raising OverflowError."""
    from lm_eval.api.metrics import weighted_perplexity as lm_eval_weighted_perplexity

    try:
        return lm_eval_weighted_perplexity(items)
    except OverflowError:
        return float("inf")


@torch.no_grad()
def evaluate(logits_fn: LogitsFn, windows: Windows, desc: str, keep_logits: int = 0) -> EvalResult:
    """Run every window through `logits_fn` and keep the log-likelihood of each actual next token and the top-1
    prediction. The full logits of the first `keep_logits` windows are kept for logit-level comparisons (SQNR)."""
    start = windows.first_target
    n = windows.seq_len - start
    logprobs = np.zeros((windows.n_windows, n), dtype=np.float64)
    top1 = np.zeros((windows.n_windows, n), dtype=np.int64)
    kept: List[torch.Tensor] = []
    for w in tqdm(range(windows.n_windows), desc=desc, unit="window", leave=False):
        ids = windows.ids[w]
        logits = logits_fn(ids)  # [T, vocab]
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"{desc}: non-finite logits in window {w}")
        predictors = logits[start - 1 : -1].double()
        targets = torch.as_tensor(ids[start:], dtype=torch.long)
        lp = torch.log_softmax(predictors, dim=-1)
        logprobs[w] = lp.gather(1, targets[:, None])[:, 0].numpy()
        top1[w] = predictors.argmax(-1).numpy()
        if w < keep_logits:
            kept.append(logits.float().clone())
    return EvalResult(logprobs=logprobs, windows=windows, top1=top1, logits=kept)


def cached_evaluation(cache, key: str, windows: Windows, run: Callable[[], EvalResult]) -> tuple[EvalResult, bool]:
    """`run()` once per key (e.g. the FP phase of one model on one set of windows), shared by every run and sweep
    job that asks for it. Stored losslessly (float64 log-likelihoods, float32 logits), so hit and miss agree."""
    def build(tmp):
        result = run()
        torch.save({"logprobs": torch.from_numpy(result.logprobs), "top1": torch.from_numpy(result.top1),
                    "logits": result.logits}, tmp / "eval.pt")
        return {"windows_sha256": windows.sha256}

    path, hit = cache.get_or_build("eval", key, build)
    stored = torch.load(path / "eval.pt", weights_only=True)
    return EvalResult(logprobs=stored["logprobs"].numpy(), windows=windows, top1=stored["top1"].numpy(),
                      logits=list(stored["logits"])), hit
