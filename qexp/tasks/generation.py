"""The generation check: greedy continuations of held-out prompts by each phase, against the FP program's.

A perplexity or an accuracy averages over many positions; a user sees text. Each prompt is the first
PROMPT_TOKENS tokens of one evaluation window (the test half of the text, never calibration data); every phase
continues it greedily for `eval.generation_tokens` tokens (no stop at EOS: the positions stay comparable). Logged per
phase against FP: `gen_identical_<phase>` (the share of prompts continued exactly as FP does), `gen_first_divergence_
<phase>` (the mean position of the first token that differs; the length where none does) and `gen_token_agreement_
<phase>` (the share of positions with FP's token), plus every continuation as text (`tasks/generation.csv`).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

import numpy as np
import pandas as pd

log = logging.getLogger("qexp")

PROMPT_TOKENS = 32


def prompts_of(windows, n: int) -> List[List[int]]:
    """The first PROMPT_TOKENS tokens of each of the first `n` windows."""
    return [[int(t) for t in windows.ids[i][:PROMPT_TOKENS]] for i in range(n)]


def greedy(scorer, prompts: Sequence[Sequence[int]], n_new: int) -> List[List[int]]:
    """`n_new` greedy tokens after each prompt, every unfinished prompt in each step's calls."""
    seqs = [list(p) for p in prompts]
    new: List[List[int]] = [[] for _ in prompts]
    for _ in range(n_new):
        for i, logits in enumerate(scorer.next_logits([tuple(s) for s in seqs])):
            token = int(logits.argmax())
            seqs[i].append(token)
            new[i].append(token)
    return new


def agreement(test: List[List[int]], reference: List[List[int]], phase: str) -> Dict[str, float]:
    same = np.array([[a == b for a, b in zip(t, r)] for t, r in zip(test, reference)], dtype=bool)
    n_new = same.shape[1]
    first = np.where(same.all(axis=1), n_new, np.argmin(same, axis=1))
    return {f"gen_identical_{phase}": float(same.all(axis=1).mean()),
            f"gen_first_divergence_{phase}": float(first.mean()),
            f"gen_token_agreement_{phase}": float(same.mean())}


def continuations_table(prompts, generated: Dict[str, List[List[int]]], tokenizer) -> pd.DataFrame:
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": i, "prompt_text": tokenizer.decode(list(prompt))}
        for phase, tokens in generated.items():
            row[phase] = tokenizer.decode(tokens[i])
        rows.append(row)
    return pd.DataFrame(rows)


def check_generation(state, programs) -> None:
    """Greedy continuations by each of `programs` (PhasePrograms, FP first), compared with FP's."""
    cfg = state.cfg
    n, n_new = int(cfg.eval.generation_check), int(cfg.eval.generation_tokens)
    prompts = prompts_of(state.windows, n)
    generated = {}
    for program in programs:
        with state.timer.stage(f"generation_{program.phase}"):
            generated[program.phase] = greedy(program.scorer, prompts, n_new)
    reference = generated["fp"]
    for phase, tokens in generated.items():
        if phase == "fp":
            continue
        metrics = agreement(tokens, reference, phase)
        state.metrics.update(metrics)
        log.info("%s generation vs FP (%d prompts x %d tokens): %.0f%% identical, first divergence at token %.1f, "
                 "%.0f%% of tokens agree", phase.upper(), n, n_new, 100 * metrics[f"gen_identical_{phase}"],
                 metrics[f"gen_first_divergence_{phase}"], 100 * metrics[f"gen_token_agreement_{phase}"])
    state.metrics["gen_prompts"] = float(n)
    state.log_text(continuations_table(prompts, generated, state.model.tokenizer).to_csv(index=False),
                   "tasks/generation.csv")
