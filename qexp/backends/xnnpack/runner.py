"""Run an XNNPACK LLM .pte on this CPU: tokens + start position in, logits out; the KV cache lives in the
program's buffers. Perplexity steps it one token per call, exactly as generation does."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from qexp.backends.bench import Generation
from qexp.backends.xnnpack.export import XnnpackProgram
from qexp.upstream.private_runtime import load_program, set_runtime_threads


def load_runtime_ops() -> None:
    """Kernels an LLM .pte needs that the pybindings load on import only (else `Missing operator:
    llama::custom_sdpa.out`)."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 - llama::custom_sdpa / update_cache
    import executorch.kernels.quantized  # noqa: F401 - quantized_decomposed::embedding_*bit


class XnnpackRunner:
    """Drives one .pte: tokens + start position in, logits out; the KV cache lives in the program's buffers."""

    def __init__(self, program: XnnpackProgram, threads: int):
        load_runtime_ops()
        self.threads = set_runtime_threads(threads)
        self.program = program
        self.module = load_program(program.pte_path)

    def forward(self, tokens: Sequence[int], start_pos: int) -> torch.Tensor:
        """Logits [1, vocab] of the last of `tokens`, placed at positions start_pos...

        Positions restart at 0 for a new sequence: the SDPA op attends to [0, start_pos + n), so what an earlier
        sequence left further on in the cache is never read."""
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = self.module.forward((ids, torch.tensor([start_pos], dtype=torch.long)))[0]
        return out.reshape(-1, out.shape[-1])

    def rows(self, inputs: Sequence[int], first: int) -> torch.Tensor:
        """Logits of positions first..len(inputs)-1 of `inputs` from position 0: the first `first + 1` tokens in one
        prefill call, then one decode step per further position (a task request's scored rows)."""
        out = [self.forward(list(inputs[: first + 1]), 0)[-1]]
        out += [self.forward([inputs[position]], position)[-1] for position in range(first + 1, len(inputs))]
        return torch.stack(out).float()

    def window_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(ids), vocab]: one decode step per position."""
        return torch.cat([self.forward([token], position) for position, token in enumerate(ids)])

    def generate(self, prompt: Sequence[int], n_new: int) -> Generation:
        """Greedy: the prompt in one prefill call, then one call per new token, timed around each call."""
        start = time.perf_counter()
        token = int(self.forward(prompt, 0)[-1].argmax())
        prefill_end = time.perf_counter()
        tokens = [token]
        for step in range(n_new - 1):
            token = int(self.forward([token], len(prompt) + step)[-1].argmax())
            tokens.append(token)
        end = time.perf_counter()
        return Generation(tokens, prefill_end - start, prefill_end - start, end - prefill_end, len(prompt))
