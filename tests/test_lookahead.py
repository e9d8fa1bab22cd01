"""Lookahead decoding: the block layout, losslessness in float on CPU, and on the HTP emulator (tiny model)."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY
from qexp.backends.htp.lookahead import LookaheadLayout, NgramPool, lookahead_decode
from qexp.models.static_llama import StaticLlama

CONTEXT = 64
PADDING = -255.0  # the static llama's masked-logit value


def test_layout_tree_mask_and_positions():
    layout = LookaheadLayout(ngram=3, window=2, gcap=2, ar_len=8)
    # rows: 0 current, 1 level-0 guess, 2-3 level 1, 4-5 candidate 0, 6-7 candidate 1
    assert layout.parents() == [-1, 0, 0, 1, 0, 4, 0, 6]
    assert layout.position_offsets() == [0, 1, 1, 2, 1, 2, 1, 2]
    mask = layout.block_mask()
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 3]  # level 1 column 1: its column and level 0's chain
    assert mask[7].nonzero().flatten().tolist() == [0, 6, 7]  # candidate 1: the current token and its own chain
    assert not mask[5, 6] and not mask[6, 5]  # candidates never see each other
    with pytest.raises(ValueError, match="rows"):
        LookaheadLayout(ngram=3, window=4, gcap=4, ar_len=8)


def test_ngram_pool_is_bounded_and_deduplicated():
    pool = NgramPool(gcap=2)
    for gram in [(1, 2), (1, 2), (3, 4), (5, 6)]:
        pool.add(7, gram)
    assert pool.candidates(7) == [(3, 4), (5, 6)] and pool.candidates(8) == []


class FloatStaticDecoder:
    """The eager float static llama at one AR length with a smart-mask cache: greedy and lookahead on CPU."""

    def __init__(self, model, ar_len: int):
        self.static = StaticLlama(model, CONTEXT, ar_len=ar_len)
        _, _, _, k, v = self.static.module.get_example_inputs()
        self.k, self.v = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
        self.ar, self.cache_len, self.n_past, self.out = ar_len, CONTEXT - ar_len, 0, None

    @torch.no_grad()
    def forward(self, tokens, positions, block_mask):
        mask = torch.full((1, 1, self.ar, CONTEXT), PADDING)
        mask[..., : self.n_past] = 0
        mask[0, 0, :, self.cache_len :][block_mask] = 0
        ids = torch.zeros(1, self.ar, dtype=torch.int32)
        ids[0, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int32)
        pos = torch.as_tensor(positions, dtype=torch.int32).reshape(1, -1)
        self.out = torch.utils._pytree.tree_leaves(self.static.module(ids, mask, pos, *self.k, *self.v))
        return self.out[0].reshape(self.ar, -1)

    def commit(self, rows):
        n_layers, index = len(self.k), torch.as_tensor(rows)
        for layer in range(n_layers):
            self.k[layer][..., self.n_past : self.n_past + len(rows)] = self.out[1 + layer].index_select(-1, index)
            self.v[layer][:, :, self.n_past : self.n_past + len(rows)] = (
                self.out[1 + n_layers + layer].index_select(2, index))
        self.n_past += len(rows)

    def step(self, token):
        positions = self.n_past + torch.arange(self.ar)
        logits = self.forward([token], positions, torch.tril(torch.ones(self.ar, self.ar, dtype=torch.bool)))
        self.commit([0])
        return int(logits[0].argmax())


def test_lookahead_is_lossless_in_float(tiny_model, corpus):
    """Same tokens as greedy decoding, and the verification branch really accepted tokens (not trivially greedy)."""
    prompt = tiny_model.tokenizer.encode(corpus.joined("test"))[:8]
    layout = LookaheadLayout(ngram=3, window=3, gcap=3, ar_len=16)  # cache: 64 - 16 = 48 slots
    greedy = FloatStaticDecoder(tiny_model, layout.ar_len)
    for token in prompt[:-1]:
        greedy.step(token)
    first, expected = prompt[-1], []
    token = first
    for _ in range(32):
        token = greedy.step(token)
        expected.append(token)

    decoder = FloatStaticDecoder(tiny_model, layout.ar_len)
    for token in prompt[:-1]:
        decoder.step(token)
    tokens, stats = lookahead_decode(decoder.forward, decoder.commit, prompt, first, decoder.n_past, 33, layout,
                                     max_past=decoder.cache_len)
    assert tokens == [first] + expected
    assert stats.steps < 32 and stats.tokens - stats.steps > 0, stats  # some calls accepted verified n-grams


HTP_LOOKAHEAD = TINY + ["quant=16a8w", "backend=htp", "backend.model_mode=lookahead", "backend.prefill_ar_len=16",
                        "backend.ngram=3", "backend.window=3", "backend.gcap=3", "backend.eval_tokens=32",
                        "backend.bench.prompt_len=16", "backend.bench.new_tokens=24", "backend.bench.warmup=0",
                        "backend.bench.repeats=1"]


@pytest.mark.parametrize("updater", ["smart_mask", "shift_pointer"])
def test_lookahead_on_htp_is_lossless(compose, store_uri, updater):
    from mlflow.tracking import MlflowClient

    from qexp.pipeline import run_experiment

    result = run_experiment(compose(HTP_LOOKAHEAD + [f"backend.kv_update={updater}"]))
    run = MlflowClient(store_uri).get_run(result.run_id)
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and tags["decoder"] == "lookahead"
    assert run.data.params["backend.model_mode"] == "lookahead"
    assert m["lookahead_matches_greedy"] == 1.0 and m["lookahead_greedy_prefix_tokens"] == 24
    assert m["lookahead_tokens_per_step"] > 1.0  # verified n-grams were accepted on HTP too
    for name in ("decode_tok_s", "decode_tok_s_greedy", "lookahead_decode_speedup", "lookahead_steps",
                 "kv_update_bytes_per_token", "ppl_deployed"):
        assert name in m, name
    assert tags["deployed_eval_path"] == "prefill"


@pytest.mark.parametrize("override,match", [
    ("backend.ngram=1", "ngram >= 2"),
    ("backend.window=20", "AR-64"),
    ("backend.bench.new_tokens=40", "does not fit"),
])
def test_bad_lookahead_configs(compose, override, match):
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match=match):
        validate(compose(HTP_LOOKAHEAD + [override]))
