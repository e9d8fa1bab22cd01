"""Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", 2024),
as ExecuTorch's Qualcomm runner (`--eval_mode 2`) does it with one AR-N decode graph.

Each call of the decode graph feeds one block of tokens under a tree attention mask (every row sees the KV cache,
its ancestors in the block and itself):

    row 0                      the current token (position p)
    lookahead branch           (ngram - 1) levels x window Jacobi guesses; level i, column j sits at p + i + j and
                               descends from level i-1 (level 0 forms a causal chain from row 0)
    verification branch        up to gcap candidate n-grams from the pool whose first token is the current token;
                               candidate g's j-th token sits at p + 1 + j and descends from row 0 through g's chain

The greedy token after row 0 is always taken. A candidate whose tokens equal the greedy continuation so far keeps
going: its rows' logits are the logits greedy decoding would compute at those positions (same tokens, same
positions, same visible prefix), so up to `ngram` tokens are accepted per call and the output is the greedy output
by construction. The Jacobi step shifts the lookahead levels and refills the last one from this call's argmax; the
columns it completes become n-grams in the pool.

This module holds the algorithm only; the runner supplies `forward` (one graph call) and `commit` (write the
accepted rows' K/V into the cache).
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Sequence, Tuple

import torch


def lookahead_width(ngram: int, window: int, gcap: int) -> int:
    """Rows a lookahead step uses; the decode graph's AR length is the next power of two (as upstream)."""
    return (window + gcap) * (ngram - 1)


@dataclass(frozen=True)
class LookaheadLayout:
    ngram: int
    window: int
    gcap: int
    ar_len: int

    def __post_init__(self):
        if self.ngram < 2 or self.window < 1 or self.gcap < 1:
            raise ValueError(f"lookahead needs ngram >= 2, window >= 1, gcap >= 1 (got {self})")
        if lookahead_width(self.ngram, self.window, self.gcap) > self.ar_len:
            raise ValueError(f"lookahead {self} needs {lookahead_width(self.ngram, self.window, self.gcap)} rows")

    def level_row(self, level: int, column: int) -> int:
        return level * self.window + column

    def verify_row(self, candidate: int, index: int) -> int:
        return (self.ngram - 1) * (self.window + candidate) + index

    def parents(self) -> List[int]:
        """Parent row of every row of the block (-1: none, the row sees only the cache and itself)."""
        parents = list(range(-1, self.ar_len - 1))  # unused padding rows: a harmless causal chain
        for level in range(self.ngram - 1):
            for column in range(self.window):
                row = self.level_row(level, column)
                parents[row] = row - 1 if level == 0 else self.level_row(level - 1, column)
        for candidate in range(self.gcap):
            for index in range(self.ngram - 1):
                row = self.verify_row(candidate, index)
                parents[row] = 0 if index == 0 else row - 1
        return parents

    def block_mask(self) -> torch.Tensor:
        """[ar_len, ar_len] bool: row r attends row c (its ancestors and itself)."""
        mask = torch.zeros(self.ar_len, self.ar_len, dtype=torch.bool)
        for row, parent in enumerate(self.parents()):  # parents precede their children
            if parent >= 0:
                mask[row] = mask[parent]
            mask[row, row] = True
        return mask

    def position_offsets(self) -> List[int]:
        offsets = list(range(self.ar_len))
        for level in range(self.ngram - 1):
            for column in range(self.window):
                offsets[self.level_row(level, column)] = level + column
        for candidate in range(self.gcap):
            for index in range(self.ngram - 1):
                offsets[self.verify_row(candidate, index)] = index + 1
        return offsets


class NgramPool:
    """Up to gcap distinct (ngram-1)-token continuations per first token, oldest replaced first."""

    def __init__(self, gcap: int):
        self.grams: Dict[int, Deque[Tuple[int, ...]]] = defaultdict(lambda: deque(maxlen=gcap))

    def add(self, first: int, continuation: Tuple[int, ...]) -> None:
        known = self.grams[first]
        if continuation not in known:
            known.append(continuation)

    def candidates(self, first: int) -> List[Tuple[int, ...]]:
        return list(self.grams.get(first, ()))


@dataclass
class LookaheadStats:
    steps: int = 0  # decode-graph calls
    tokens: int = 0  # tokens produced by them
    accepted_per_step: List[int] = field(default_factory=list)

    def metrics(self) -> dict:
        steps = max(self.steps, 1)
        return {"lookahead_steps": self.steps, "lookahead_tokens_per_step": self.tokens / steps,
                "lookahead_verified_tokens": self.tokens - self.steps}


Forward = Callable[[List[int], List[int], torch.Tensor], torch.Tensor]  # (tokens, positions, block mask) -> logits


def lookahead_decode(
    forward: Forward, commit: Callable[[List[int]], None], prompt: Sequence[int], first_token: int, n_past: int,
    n_new: int, layout: LookaheadLayout, max_past: int, seed: int = 0,
) -> Tuple[List[int], LookaheadStats]:
    """`n_new` tokens starting with `first_token` (the prefill's greedy token), `n_past` tokens already cached.

    forward(tokens, positions, mask) runs one block and returns its logits [ar_len, vocab]; commit(rows) appends those
    rows' K/V to the cache, in order. `max_past` is the cache capacity.
    """
    window, ngram = layout.window, layout.ngram
    rng = random.Random(seed)  # the lookahead branch starts from prompt tokens, reproducibly
    pool = [int(t) for t in prompt[1:]] or [int(first_token)]
    levels = [[rng.choice(pool) for _ in range(window)] for _ in range(ngram - 1)]
    ngrams = NgramPool(layout.gcap)
    mask, offsets = layout.block_mask(), layout.position_offsets()
    tokens, current, stats = [int(first_token)], int(first_token), LookaheadStats()
    while len(tokens) < n_new:
        if n_past + ngram > max_past:
            raise RuntimeError(f"lookahead decoding ran out of cache ({n_past} of {max_past} slots used)")
        block = [0] * layout.ar_len
        for level in range(ngram - 1):
            for column in range(window):
                block[layout.level_row(level, column)] = levels[level][column]
        block[0] = current
        candidates = ngrams.candidates(current)
        for g, candidate in enumerate(candidates):
            for index, token in enumerate(candidate):
                block[layout.verify_row(g, index)] = token
        logits = forward(block, [n_past + o for o in offsets], mask)
        greedy = logits.argmax(-1).tolist()

        # verification: follow the candidates that agree with the greedy continuation
        rows, accepted, alive = [0], [greedy[0]], list(range(len(candidates)))
        for depth in range(ngram - 1):
            alive = [g for g in alive if candidates[g][depth] == accepted[-1]]
            if not alive:
                break
            row = layout.verify_row(alive[0], depth)
            rows.append(row)
            accepted.append(greedy[row])

        # Jacobi step: shift the levels, refill the last from this call; completed columns become n-grams
        firsts = levels[0]
        last = [greedy[layout.level_row(ngram - 2, column)] for column in range(window)]
        levels = levels[1:] + [last]
        for column in range(window):
            ngrams.add(firsts[column], tuple(levels[level][column] for level in range(ngram - 1)))

        commit(rows)
        n_past += len(rows)
        tokens.extend(accepted)
        current = accepted[-1]
        stats.steps += 1
        stats.tokens += len(accepted)
        stats.accepted_per_step.append(len(accepted))
    return tokens[:n_new], stats
