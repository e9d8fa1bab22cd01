"""Evaluate stage: the same token windows through any phase's model, and perplexity metrics over them.

Windows are non-overlapping runs of `eval.seq_len` tokens of the test split (the first token is BOS when the model
adds one), so every phase scores exactly the same token ids. Token perplexity is over the predicted positions;
word and byte perplexity and bits per byte use lm-eval's own aggregation functions (`weighted_perplexity`,
`bits_per_byte`) and its word/byte counting (`PerplexityTask.count_words/count_bytes`), applied to the text
each window predicts.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from qexp.errors import InputError
from qexp.tokenizer import Tokenizer

log = logging.getLogger("qexp")

LogitsFn = Callable[[np.ndarray], torch.Tensor]  # window token ids [T] -> logits [T, vocab]


@dataclass
class Windows:
    ids: np.ndarray  # int64 [n_windows, seq_len]: exactly what is fed to the model
    first_target: int  # index of the first predicted position (1: position 0 has no context)
    words: np.ndarray  # words in the text each window predicts (lm-eval's count_words)
    bytes: np.ndarray  # UTF-8 bytes of that text (lm-eval's count_bytes)
    add_bos: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.ids, dtype=np.int64).tobytes()).hexdigest()

    @property
    def n_windows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[1])

    @property
    def n_predicted(self) -> int:
        return self.n_windows * (self.seq_len - self.first_target)

    def head(self, n_windows: int, n_tokens: int, tokenizer: Tokenizer) -> "Windows":
        """The first n_tokens of the first n_windows windows: a subset every phase can score identically."""
        from lm_eval.api.task import PerplexityTask

        ids = self.ids[:n_windows, :n_tokens]
        text = [tokenizer.decode(row[self.first_target :]) for row in ids]
        return Windows(
            ids=ids,
            first_target=self.first_target,
            words=np.array([PerplexityTask.count_words(t) for t in text]),
            bytes=np.array([PerplexityTask.count_bytes(t) for t in text]),
            add_bos=self.add_bos,
        )


def encode_prefix(text: str, tokenizer: Tokenizer, n_tokens: int, chunk_chars: Optional[int] = None) -> List[int]:
    """Token ids of the start of `text`, at least `n_tokens` of them when the text has that many.

    Tokenizes paragraph-aligned chunks (so no token straddles a cut) only until enough ids exist: a split of the
    text is ~300k tokens, and windows or calibration samples need a few thousand.
    """
    ids: List[int] = []
    pos, chunk = 0, chunk_chars or max(4 * n_tokens, 20000)
    while len(ids) < n_tokens and pos < len(text):
        end = text.find("\n\n", pos + chunk)
        end = len(text) if end < 0 else end
        ids.extend(tokenizer.encode(text[pos:end]))
        pos = end
    return ids


def make_windows(text: str, tokenizer: Tokenizer, seq_len: int, limit: int, add_bos: bool) -> Windows:
    from lm_eval.api.task import PerplexityTask

    if limit < 1 or seq_len < 2:
        raise InputError(f"eval.limit={limit} and eval.seq_len={seq_len} leave nothing to score", "use limit>=1, seq_len>=2")
    body = seq_len - 1 if add_bos else seq_len
    bos = tokenizer.bos_id
    if add_bos and bos is None:
        raise InputError(f"model.add_bos=true but tokenizer {tokenizer.path} has no BOS token", "set model.add_bos=false")
    needed = body * limit
    ids = encode_prefix(text, tokenizer, needed)
    if len(ids) < needed:
        raise InputError(
            f"the test text has {len(ids)} tokens, fewer than eval.limit x seq_len = {needed}",
            "lower eval.limit or eval.seq_len",
        )
    rows = np.asarray(ids[:needed], dtype=np.int64).reshape(limit, body)
    if add_bos:
        rows = np.concatenate([np.full((limit, 1), bos, dtype=np.int64), rows], axis=1)
    first_target = 1
    predicted_text = [tokenizer.decode(row[first_target:]) for row in rows]
    return Windows(
        ids=rows,
        first_target=first_target,
        words=np.array([PerplexityTask.count_words(t) for t in predicted_text]),
        bytes=np.array([PerplexityTask.count_bytes(t) for t in predicted_text]),
        add_bos=add_bos,
    )


@dataclass
class EvalResult:
    """Per-position log-likelihoods of one phase; metrics on all windows or a subset."""

    logprobs: np.ndarray  # float64 [n_windows, seq_len - first_target]
    windows: Windows
    top1: np.ndarray  # int64 [n_windows, seq_len - first_target]: argmax predictions (for agreement)
    logits: List[torch.Tensor] = field(default_factory=list)  # full logits of the first `keep_logits` windows
    extras: Dict[str, float] = field(default_factory=dict)

    def head(self, windows: Windows) -> "EvalResult":
        """This result restricted to a `Windows.head` subset (causal: the first positions do not see the rest)."""
        n = windows.seq_len - windows.first_target
        return EvalResult(
            logprobs=self.logprobs[: windows.n_windows, :n], windows=windows, top1=self.top1[: windows.n_windows, :n]
        )

    def metrics(self, rows: Optional[np.ndarray] = None) -> Dict[str, float]:
        from lm_eval.api.metrics import bits_per_byte, weighted_perplexity

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


@torch.no_grad()
def evaluate(
    logits_fn: LogitsFn, windows: Windows, desc: str, reference: "EvalResult | None" = None, keep_logits: int = 0
) -> EvalResult:
    """Run every window through `logits_fn` and keep the log-likelihood of each actual next token.

    With `reference` (the FP result), also measure top-1 agreement with it. The full logits of the first
    `keep_logits` windows are kept for logit-level comparisons (SQNR) between phases.
    """
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
    result = EvalResult(logprobs=logprobs, windows=windows, top1=top1, logits=kept)
    if reference is not None:
        result.extras["top1_agreement"] = float((top1 == reference.top1).mean())
    return result


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


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `reference`, in dB."""
    noise = (reference.double() - test.double()).pow(2).mean().item()
    signal = reference.double().pow(2).mean().item()
    return float("inf") if noise == 0 else 10 * math.log10(signal / noise)
