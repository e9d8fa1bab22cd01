"""Windows and metrics: the ids fed to every phase, token/word/byte perplexity as lm-eval defines them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qexp.core.errors import InputError
from qexp.data.windows import make_windows
from qexp.eval.perplexity import evaluate


def test_windows_shape_and_bos(tiny_model, corpus):
    text = corpus.joined("test")
    with_bos = make_windows(text, tiny_model.tokenizer, seq_len=32, limit=5, add_bos=True)
    without = make_windows(text, tiny_model.tokenizer, seq_len=32, limit=5, add_bos=False)
    assert with_bos.ids.shape == without.ids.shape == (5, 32)
    assert (with_bos.ids[:, 0] == tiny_model.tokenizer.bos_id).all()
    assert not (without.ids[:, 0] == tiny_model.tokenizer.bos_id).all()
    # non-overlapping, consecutive text: window 2 continues where window 1 stopped
    flat = with_bos.ids[:, 1:].reshape(-1)
    assert (flat == without.ids.reshape(-1)[: flat.size]).all()
    assert with_bos.n_predicted == 5 * 31
    assert (with_bos.words > 0).all() and (with_bos.bytes > with_bos.words).all()


def test_windows_are_deterministic(tiny_model, corpus):
    a = make_windows(corpus.joined("test"), tiny_model.tokenizer, 32, 3, True)
    b = make_windows(corpus.joined("test"), tiny_model.tokenizer, 32, 3, True)
    assert a.sha256 == b.sha256


def test_too_few_tokens(tiny_model):
    with pytest.raises(InputError, match="fewer than"):
        make_windows("a short text", tiny_model.tokenizer, 32, 4, True)


def test_uniform_model_has_vocab_perplexity(tiny_model, corpus):
    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, 32, 3, True)
    vocab = tiny_model.params["vocab_size"]
    result = evaluate(lambda ids: torch.zeros(len(ids), vocab), windows, "uniform")
    assert result.metrics()["ppl"] == pytest.approx(vocab)


def test_metrics_follow_lm_eval_definitions(tiny_model, corpus):
    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, 32, 4, True)
    generator = torch.Generator().manual_seed(0)
    fixed = {}

    def logits_fn(ids):
        key = ids.tobytes()
        fixed.setdefault(key, torch.randn(len(ids), 512, generator=generator))
        return fixed[key]

    result = evaluate(logits_fn, windows, "random")
    m = result.metrics()
    total_ll = result.logprobs.sum()
    assert m["ppl"] == pytest.approx(math.exp(-total_ll / result.logprobs.size))
    assert m["word_ppl"] == pytest.approx(math.exp(-total_ll / windows.words.sum()))
    assert m["byte_ppl"] == pytest.approx(math.exp(-total_ll / windows.bytes.sum()))
    assert m["bits_per_byte"] == pytest.approx(-total_ll / windows.bytes.sum() / math.log(2))
    # a subset of windows gives the metric of just those windows
    sub = result.metrics(np.array([1, 3]))
    assert sub["ppl"] == pytest.approx(math.exp(-result.logprobs[[1, 3]].sum() / result.logprobs[[1, 3]].size))
    # log-likelihood is of the actual next token
    ids = windows.ids[0]
    lp = torch.log_softmax(logits_fn(ids).double(), -1)
    assert result.logprobs[0, 0] == pytest.approx(lp[0, ids[1]].item())


def test_comparison_with_itself(tiny_model, corpus):
    from qexp.eval.compare import compare

    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, 16, 2, True)
    fn = lambda ids: torch.arange(len(ids) * 512, dtype=torch.float32).reshape(len(ids), 512)  # noqa: E731
    first = evaluate(fn, windows, "a", keep_logits=1)
    second = evaluate(fn, windows, "b", keep_logits=1)
    assert compare(second, first, "b", "a") == {"ppl_b_vs_a": 0.0, "top1_agreement_b_vs_a": 1.0,
                                                "logits_sqnr_db_b_vs_a": float("inf"), "ppl_b_vs_a_ci_low": 0.0,
                                                "ppl_b_vs_a_ci_high": 0.0, "ppl_b_vs_a_ci_units": 2.0}


def test_comparison_refuses_different_windows(tiny_model, corpus):
    from qexp.eval.compare import compare

    fn = lambda ids: torch.zeros(len(ids), 512)  # noqa: E731
    short = evaluate(fn, make_windows(corpus.joined("test"), tiny_model.tokenizer, 16, 2, True), "a")
    longer = evaluate(fn, make_windows(corpus.joined("test"), tiny_model.tokenizer, 16, 3, True), "b")
    with pytest.raises(ValueError, match="different windows"):
        compare(longer, short, "b", "a")
