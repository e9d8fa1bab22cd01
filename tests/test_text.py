"""Text source: WikiText-2 when given locally, else the gensim excerpt split by article; always through datasets."""

from __future__ import annotations

import datasets
import pytest

from qexp.cache import Cache
from qexp.config import TextConfig
from qexp.errors import InputError
from qexp.data.text import GENSIM_EXCERPT, WIKITEXT2, load_corpus


def test_gensim_fallback_split_by_article(corpus):
    assert corpus.source == GENSIM_EXCERPT and not corpus.comparable_to_wikitext2
    assert isinstance(corpus.test, datasets.Dataset)
    calibration_titles, test_titles = set(corpus.calibration["title"]), set(corpus.test["title"])
    assert calibration_titles and test_titles and not calibration_titles & test_titles
    assert 40 < len(corpus.test) < 70
    chars = corpus.n_chars
    assert chars["test"] > 500_000 and chars["calibration"] > 500_000
    assert "'''" not in corpus.test["text"][0]  # wiki markup stripped


def test_fallback_warns(cache_dir, caplog):
    with caplog.at_level("WARNING", logger="qexp"):
        load_corpus(TextConfig(), Cache(cache_dir))
    assert "NOT comparable" in caplog.text


def test_local_wikitext_path(tmp_path, cache_dir):
    train = ["", " = Valkyria = \n", " The game began development in 2010 . \n"]
    test = ["", " = Robert Boulter = \n", " Robert Boulter is an English film actor . \n"]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": train}),
        "test": datasets.Dataset.from_dict({"text": test}),
    }).save_to_disk(str(tmp_path / "wikitext"))
    corpus = load_corpus(TextConfig(wikitext_path=str(tmp_path / "wikitext")), Cache(cache_dir))
    assert corpus.source == WIKITEXT2 and corpus.comparable_to_wikitext2
    assert corpus.joined("test") == "".join(test)


def test_missing_wikitext_path(tmp_path, cache_dir):
    with pytest.raises(InputError, match="not found"):
        load_corpus(TextConfig(wikitext_path=str(tmp_path / "nothing")), Cache(cache_dir))


def test_no_fallback(cache_dir):
    with pytest.raises(InputError, match="allow_fallback"):
        load_corpus(TextConfig(allow_fallback=False), Cache(cache_dir))
