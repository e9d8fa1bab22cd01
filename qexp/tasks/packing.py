"""Score many short token sequences through one static-llama program, several per call.

The static graph always runs `ar_len` positions, so an 80-token task item alone wastes two thirds of a call. Its
attention mask and RoPE positions are graph inputs, so sequences can share a call: each gets its own block of the
mask (the rows a lone sequence starting at position 0 would get, sliding windows included) and positions counting
from 0; every other mask entry keeps the graph's masked value. Requests that share their context (the choices of a
multiple-choice item) share it in the call too: the context once, then each continuation attending to the context
and to itself, at the positions it would have alone. A masked score's softmax weight underflows to exactly 0 in
float32, so each request's logits are those of the request run alone up to float summation order (a test checks it
on the float and the QDQ program).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from qexp.core.device import move


@dataclass(frozen=True)
class ScoreRequest:
    """Input tokens and the targets their last `len(targets)` positions predict."""

    inputs: Tuple[int, ...]
    targets: Tuple[int, ...]

    @property
    def prefix_len(self) -> int:
        """Inputs up to the one that predicts the first target: what requests of one context share."""
        return len(self.inputs) - len(self.targets) + 1


@dataclass
class Scored:
    logprob: float  # sum of the targets' log-likelihoods
    greedy: bool  # every target is the argmax of its position
    logprobs: np.ndarray  # per target (float64)


@dataclass
class Block:
    """A shared prefix and the branches that continue it; each branch sees the prefix and itself."""

    prefix: Tuple[int, ...]
    branches: List[Tuple[int, ...]] = field(default_factory=list)
    owners: List[int] = field(default_factory=list)  # the request (or sequence) index of each branch

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.branches))


def pack(lengths: Sequence[int], ar_len: int) -> List[List[int]]:
    """Indices of blocks grouped into calls of at most `ar_len` positions (first fit, longest first, so the grouping
    depends only on the lengths: the same requests give the same calls)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    calls: List[List[int]] = []
    free: List[int] = []
    for i in order:
        n = lengths[i]
        if n > ar_len or n < 1:
            raise ValueError(f"a sequence of {n} tokens for a graph of {ar_len} positions")
        for c, room in enumerate(free):
            if n <= room:
                calls[c].append(i)
                free[c] -= n
                break
        else:
            calls.append([i])
            free.append(ar_len - n)
    return calls


def blocks_of(requests: Sequence[ScoreRequest], ar_len: int) -> List[Block]:
    """Requests with the same prefix in one block (as many branches as fit the graph), the rest alone."""
    blocks: List[Block] = []
    by_prefix: Dict[Tuple[int, ...], Block] = {}
    for i, request in enumerate(requests):
        prefix = request.inputs[: request.prefix_len]
        branch = request.inputs[request.prefix_len:]
        block = by_prefix.get(prefix)
        if block is None or len(block) + len(branch) > ar_len:
            block = by_prefix[prefix] = Block(prefix)
            blocks.append(block)
        block.branches.append(branch)
        block.owners.append(i)
    return blocks


class PackedScorer:
    """One program (the float static llama or a QDQ program) and its static llama's input layout. `head_rows`
    (qexp/tasks/head_rows.py) runs the output head on the positions a call scores only; without it the program's
    full logits are computed and the rows taken from them."""

    def __init__(self, module, static, desc: str = "tasks", head_rows=None, device=None):
        self.module, self.static, self.desc, self.head_rows = module, static, desc, head_rows
        # the run's device: the scorer moves its module there at its first call; inputs and head rows go there,
        # logits come back to the CPU
        self.device = device if device is not None and device.type != "cpu" else None
        self._moved = False
        if head_rows is not None:
            head_rows.device = self.device
        self.ar_len = static.ar_len
        example = static.example_inputs()
        self.n_masks = static.n_masks
        self._masks = [m.clone() for m in example[1: 1 + self.n_masks]]
        self._caches = example[2 + self.n_masks:]
        self._masked_value = float(self._masks[0].min())

    def _place(self, masks, positions, start: int, first: int, cols: Tuple[int, int], own: int, n: int) -> None:
        """Rows start..start+n hold positions first..first+n of a sequence whose earlier positions 0..first sit in
        columns cols (a shared prefix; empty for a lone sequence) and whose own rows follow from column `own`."""
        positions[0, start: start + n] = torch.arange(first, first + n, dtype=torch.int32)
        for packed, lone in zip(masks, self._masks):
            rows = lone[..., first: first + n, :]
            if first:
                packed[..., start: start + n, cols[0]: cols[1]] = rows[..., :first]
            packed[..., start: start + n, own: own + n] = rows[..., first: first + n]

    def _inputs(self, blocks: List[Block]) -> Tuple[Tuple[torch.Tensor, ...], List[Tuple[int, List[int]]]]:
        """The call's inputs, and where each block's prefix and branches start."""
        ar = self.ar_len
        tokens = torch.zeros((1, ar), dtype=torch.int32)
        positions = torch.zeros((1, ar), dtype=torch.int32)
        masks = [torch.full_like(m, self._masked_value) for m in self._masks]
        layout = []
        offset = 0
        for block in blocks:
            p = len(block.prefix)
            tokens[0, offset: offset + p] = torch.as_tensor(block.prefix, dtype=torch.int32)
            self._place(masks, positions, offset, 0, (offset, offset), offset, p)
            starts, at = [], offset + p
            for branch in block.branches:
                if branch:
                    tokens[0, at: at + len(branch)] = torch.as_tensor(branch, dtype=torch.int32)
                    self._place(masks, positions, at, p, (offset, offset + p), at, len(branch))
                starts.append(at)
                at += len(branch)
            layout.append((offset, starts))
            offset = at
        if offset < ar:  # the padding: a lone sequence of its own, as a short sequence's padding is
            self._place(masks, positions, offset, 0, (offset, offset), offset, ar - offset)
        return (tokens, *masks, positions, *self._caches), layout

    def _logits(self, inputs, rows: List[int]) -> torch.Tensor:
        """The call's logits [len(rows), vocab] at positions `rows`, on the CPU."""
        return self.forward(inputs, rows).cpu()

    def forward(self, inputs, rows: List[int]) -> torch.Tensor:
        """The call's logits at positions `rows`, on the module's device."""
        if self.device is not None:
            if not self._moved:  # the scorer's module stays on the device from its first call (lm-eval calls it
                move(self.module, self.device)  # many times, from a harness with no scope to place it in)
                self._moved = True
            inputs = tuple(t.to(self.device) for t in inputs)
        with self.head_rows.selecting(rows) if self.head_rows is not None else nullcontext():
            result = self.module(*inputs)
        logits = result[0] if isinstance(result, (tuple, list)) else result
        logits = logits.reshape(-1, logits.shape[-1])
        logits = logits if self.head_rows is not None else logits[rows]
        return logits if logits.dtype == torch.float64 else logits.float()  # a float64 program keeps its digits

    @torch.no_grad()
    def _calls(self, blocks: List[Block], rows_of) -> Iterator[Tuple[List[Block], List[List[int]], torch.Tensor]]:
        """Per call: its blocks, the positions `rows_of(block, prefix start, branch starts)` asks of each block, and
        the logits of those positions, block after block."""
        for call in tqdm(pack([len(b) for b in blocks], self.ar_len), desc=self.desc, unit="call", leave=False):
            chosen = [blocks[i] for i in call]
            inputs, layout = self._inputs(chosen)
            wanted = [rows_of(block, start, starts) for block, (start, starts) in zip(chosen, layout)]
            logits = self._logits(inputs, [row for rows in wanted for row in rows])
            if not torch.isfinite(logits).all():
                raise FloatingPointError(f"{self.desc}: non-finite logits")
            yield chosen, wanted, logits

    def next_logits(self, seqs: List[Tuple[int, ...]]) -> List[torch.Tensor]:
        """The logits after each sequence (what greedy generation takes the next token from)."""
        out: Dict[int, torch.Tensor] = {}
        blocks = [Block(tuple(s), [()], [i]) for i, s in enumerate(seqs)]
        for chosen, _, logits in self._calls(blocks, lambda block, start, _: [start + len(block.prefix) - 1]):
            for at, block in enumerate(chosen):  # one row per block
                out[block.owners[0]] = logits[at]
        return [out[i] for i in range(len(seqs))]

    def score(self, requests: List[ScoreRequest]) -> List[Scored]:
        """Each request's target log-likelihoods (log-softmax in float64, as the perplexity phases compute it).
        The rows of one call are normalised together: one large temporary per call, not two per request (many
        mid-sized temporaries fragmented the heap by GiBs over a task suite)."""
        def rows_of(block, start, starts):  # per branch: the prefix's last position, then the branch's own
            last_prefix = start + len(block.prefix) - 1
            return [row for branch, at in zip(block.branches, starts)
                    for row in (last_prefix, *range(at, at + len(branch)))]

        scored: Dict[int, Scored] = {}
        for chosen, _, logits in self._calls(blocks_of(requests, self.ar_len), rows_of):
            owners = [(owner, len(branch) + 1)
                      for block in chosen for owner, branch in zip(block.owners, block.branches)]
            self._normalise(logits, owners, requests, scored)
        return [scored[i] for i in range(len(requests))]

    @staticmethod
    def _normalise(predictors, owners, requests, scored) -> None:
        targets = torch.as_tensor([t for owner, _ in owners for t in requests[owner].targets], dtype=torch.long)
        target_logits = predictors.gather(1, targets[:, None])[:, 0].double()
        lp = (target_logits - torch.logsumexp(predictors.double(), dim=-1)).numpy()
        hits = (predictors.argmax(-1) == targets).numpy()
        at = 0
        for owner, n in owners:
            scored[owner] = Scored(float(lp[at: at + n].sum()), bool(hits[at: at + n].all()), lp[at: at + n].copy())
            at += n


def normalised(rows: torch.Tensor, targets: Sequence[int]) -> Scored:
    """One request's score from the logits rows that predict its targets, as PackedScorer computes it."""
    wanted = torch.as_tensor(list(targets), dtype=torch.long)
    lp = (rows.gather(1, wanted[:, None])[:, 0].double() - torch.logsumexp(rows.double(), dim=-1)).numpy()
    hits = (rows.argmax(-1) == wanted).numpy()
    return Scored(float(lp.sum()), bool(hits.all()), lp.copy())
