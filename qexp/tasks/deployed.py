"""A deployed program (the XNNPACK .pte on this CPU, the HTP program on the x86 emulator) as a task scorer.

A deployed program cannot pack several requests into one call as the static llama's PyTorch graph can
(qexp/tasks/packing.py): its runner takes one sequence from position 0 and gives the logits of some positions of
it. So each request runs alone, and the run scores only the first `eval.deployed_task_limit` items of each task on
it (explicit: the emulator takes seconds per call). The scorer has PackedScorer's interface (`ar_len`, `score`,
`next_logits`), so QexpLM and lm-eval treat it as any other phase. Each backend gives its rows function
(qexp/backends/xnnpack/runner.py, qexp/backends/htp/phase.py).
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
from tqdm import tqdm

from qexp.tasks.packing import Scored, ScoreRequest, normalised

# rows(inputs, first) -> logits [len(inputs) - first, vocab] of positions first..len(inputs)-1 of `inputs` run from
# position 0 (the rows that predict the tokens after them)
RowsFn = Callable[[Sequence[int], int], torch.Tensor]


class DeployedScorer:
    def __init__(self, rows: RowsFn, max_length: int, desc: str):
        self.rows, self.ar_len, self.desc = rows, int(max_length), desc

    def score(self, requests: List[ScoreRequest]) -> List[Scored]:
        out = []
        for request in tqdm(requests, desc=self.desc, unit="request", leave=False):
            first = request.prefix_len - 1
            logits = self.rows(request.inputs, first)
            if not torch.isfinite(logits).all():
                raise FloatingPointError(f"{self.desc}: non-finite logits")
            out.append(normalised(logits, request.targets))
        return out

    def next_logits(self, seqs: List[Tuple[int, ...]]) -> List[torch.Tensor]:
        """The logits after each sequence (what greedy generation takes the next token from)."""
        return [self.rows(seq, len(seq) - 1)[-1] for seq in seqs]
