"""A qexp program as an lm-eval model: `QexpLM`.

It follows lm-eval's `hf` model in everything that decides a score (the context/continuation split of
`TemplateLM`, the left truncation to the model's length, `get_rolling_token_windows` for rolling log-likelihoods,
the prefix token of an empty context), so the float program's log-likelihoods equal `hf`'s on the same weights (a
test checks it). What differs is how the work is run: requests go through the static llama's graph several per
call (qexp/tasks/packing.py), and greedy generation packs every unfinished request into each step's calls.

Build one from a phase of a run (`QexpLM.from_phase`), or from lm-eval's command line through qexp's entry point
(`python -m qexp.lm_eval --model qexp --model_args run=<run id>,phase=qdq ...`, or `overrides=<hydra overrides>`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from qexp.tasks.packing import PackedScorer, ScoreRequest


MAX_GEN_TOKS = 256  # lm-eval's default for generation tasks that set none


class QexpLM(TemplateLM):
    def __init__(self, scorer: PackedScorer, tokenizer, add_bos: bool):
        """`scorer`: the phase's program (a PackedScorer, or a deployed program's qexp.tasks.deployed.DeployedScorer:
        `ar_len`, `score`, `next_logits`); `tokenizer`: the model's qexp tokenizer; `add_bos`: whether the model's
        inputs start with BOS (qexp's model setting, as lm-eval's `add_bos_token`)."""
        super().__init__()
        self.scorer, self.qexp_tokenizer, self.add_bos = scorer, tokenizer, bool(add_bos)
        self.tokenizer = getattr(tokenizer, "_impl", None)  # lm-eval's chat templating reads it (HF only)

    # ---- what lm-eval asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.qexp_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.qexp_tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.ar_len

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        ids = self.qexp_tokenizer.encode(string)
        bos = self.qexp_tokenizer.bos_id
        add = self.add_bos if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and bos is not None and ids[:1] == [bos]:
            add = False  # the string already starts with BOS (as lm-eval's hf model checks)
        return ([bos] if add and bos is not None else []) + ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.qexp_tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        scored = self.scorer.score([self._request(context, continuation) for _, context, continuation in requests])
        return [(s.logprob, s.greedy) for s in scored]

    def _request(self, context: List[int], continuation: List[int]) -> ScoreRequest:
        n = self.max_length
        if len(continuation) > n:
            raise ValueError(f"a continuation of {len(continuation)} tokens: the graph scores at most {n}")
        # lm-eval hf's truncation: the last max_length inputs, of which the last len(continuation) are scored
        inputs = (list(context) + list(continuation))[-(n + 1):][:-1]
        return ScoreRequest(tuple(inputs), tuple(continuation))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        from lm_eval import utils

        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, predicted in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(self._request(context, predicted))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, scored in zip(owner, self.scorer.score(windows)):
            totals[i] += scored.logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy continuations (sampling settings are not supported: qexp compares programs, not samples)."""
        states = []
        for context, gen_kwargs in (req.args for req in requests):
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample") or gen_kwargs.get("temperature", 0) not in (0, 0.0, None):
                raise ValueError("qexp generates greedily: set do_sample=false / temperature=0 for this task")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", MAX_GEN_TOKS))
            states.append({"tokens": self.tok_encode(context), "new": [], "until": until, "max": max_new})
        active = [s for s in states if s["max"] > 0]
        with tqdm(total=sum(s["max"] for s in active), desc="generate", leave=False, disable=disable_tqdm) as bar:
            while active:
                seqs = [tuple((s["tokens"] + s["new"])[-self.max_length:]) for s in active]
                for s, logits in zip(active, self.scorer.next_logits(seqs)):
                    s["new"].append(int(logits.argmax()))
                bar.update(len(active))
                active = [s for s in active if not self._finished(s)]
        return [self._cut(s) for s in states]

    def _finished(self, state) -> bool:
        if len(state["new"]) >= state["max"] or state["new"][-1] == self.eot_token_id:
            return True
        text = self.tok_decode(state["new"])
        return any(stop in text for stop in state["until"])

    def _cut(self, state) -> str:
        new = [t for t in state["new"] if t != self.eot_token_id]
        text = self.tok_decode(new)
        for stop in state["until"]:
            if stop in text:
                text = text.split(stop)[0]
        return text
