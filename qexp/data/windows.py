"""Evaluation windows: non-overlapping runs of `eval.seq_len` tokens of the test split (the first token is BOS when
the model adds one), so every phase scores exactly the same token ids. Each window also carries the word and byte
counts of the text it predicts (lm-eval's `count_words` / `count_bytes`) for word and byte perplexity.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from qexp.core.errors import InputError
from qexp.models.tokenizer import Tokenizer


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

    def within_budget(self, tokens: int, tokenizer: Tokenizer) -> "Windows":
        """The head of at most `tokens` tokens a deployed program scores: whole windows first; a budget below one
        window takes the first `tokens` tokens of window 0."""
        if tokens >= self.seq_len:
            return self.head(min(self.n_windows, tokens // self.seq_len), self.seq_len, tokenizer)
        return self.head(1, max(tokens, 2), tokenizer)

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


def make_windows(text: str, tokenizer: Tokenizer, seq_len: int, limit: int | str, add_bos: bool) -> Windows:
    from lm_eval.api.task import PerplexityTask

    if (limit != "all" and limit < 1) or seq_len < 2:
        raise InputError(f"eval.limit={limit} and eval.seq_len={seq_len} leave nothing to score",
                         "use limit>=1, seq_len>=2")
    body = seq_len - 1 if add_bos else seq_len
    bos = tokenizer.bos_id
    if add_bos and bos is None:
        raise InputError(f"model.add_bos=true but tokenizer {tokenizer.path} has no BOS token",
                         "set model.add_bos=false")
    if limit == "all":  # every whole window of the text
        ids = encode_prefix(text, tokenizer, len(text) + 1)
        limit = len(ids) // body
    else:
        ids = encode_prefix(text, tokenizer, body * limit)
    needed = body * limit
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
