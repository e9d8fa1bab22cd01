"""Text sources: WikiText-2 when given locally, else the gensim excerpt split by article; the Lee news articles split
by story; Jane Austen's novels (Debian's r-cran-janeaustenr, optional) split by chapter. Always through datasets."""

from __future__ import annotations

import re

# qexp first: it sets HF_DATASETS_OFFLINE, which `datasets` reads when imported (imported before it, every look for
# WikiText-2 in the datasets cache waits ~45 s for the hub to time out).
import qexp  # noqa: F401, I001
import datasets  # noqa: E402
import pytest
from mlflow.tracking import MlflowClient

from helpers import TINY
from qexp.cache import Cache, file_sha256
from qexp.core.config import TextConfig
from qexp.data.calibration import build_calibration, check_disjoint
from qexp.data.text import load_corpus
from qexp.data.text_sources import AUSTEN, AUSTEN_NOVELS, GENSIM_EXCERPT, LEE_NEWS, WIKITEXT2, austen_path
from qexp.data.windows import make_windows
from qexp.core.errors import ConfigError, InputError

# The texts' sha256 (both halves): a change of split rule or cleaning must change these on purpose (and bump the
# source's split version in qexp/data/text_sources.py, which keys the cached split).
GENSIM_EXCERPT_SHA256 = "b1406d54111a4d00494b9cf328083f6316a6f5730822b1b823540028f2b1e034"
LEE_NEWS_SHA256 = "b039b47f29a636fddddb9fb63610b94cc015a0919716344e5de52ed768d1678b"
# by the sha256 of janeaustenr's Rdata.rdb (Debian r-cran-janeaustenr 1.0.0-1); another version has other text
AUSTEN_SHA256 = {"8fb5198960d0da724b1562f96e4221e5c1b41ff455000280b02c55980c3d8f21":
                 "234070a2e60f7b624ac2a9efe15f8401bbe2076613e8b3dadc2f49cf0b0ead77"}
AUSTEN_MISSING = "text=austen needs the Debian package r-cran-janeaustenr (apt-get install r-cran-janeaustenr)"
needs_austen = pytest.mark.skipif(austen_path() is None, reason=AUSTEN_MISSING)


def _shared_runs(corpus, n_words: int) -> set:
    """Runs of n_words words that occur in both halves."""
    def runs(split):
        found = set()
        for text in split["text"]:
            words = text.split()
            found.update(tuple(words[i : i + n_words]) for i in range(len(words) - n_words + 1))
        return found

    return runs(corpus.calibration) & runs(corpus.test)


def _check_run_sized_disjoint(corpus, tokenizer):
    """A run's calibration samples (spread over the calibration half) share no 24-token run with its windows."""
    from qexp.core.config import CalibrationConfig, CalibrationKind, CalibrationSampling

    windows = make_windows(corpus.joined("test"), tokenizer, 64, 16, True)
    for sampling in CalibrationSampling:
        cfg = CalibrationConfig(name="wikitext", kind=CalibrationKind.wikitext, limit=16, seq_len=64, sampling=sampling)
        check_disjoint(build_calibration(cfg, corpus, tokenizer, True, 64), windows)


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


def test_gensim_excerpt_unchanged(corpus):
    """text=wikitext (its gensim fallback) is bit-identical to before the other texts: same split, same sha256."""
    assert corpus.sha256 == GENSIM_EXCERPT_SHA256
    assert (len(corpus.calibration), len(corpus.test)) == (53, 53)
    assert corpus.location.endswith(".bz2") and "{" not in corpus.location


@pytest.fixture(scope="module")
def news(cache_dir):
    return load_corpus(TextConfig(source="news"), Cache(cache_dir))


def test_news_split_by_story(news, cache_dir):
    assert news.source == LEE_NEWS and not news.comparable_to_wikitext2
    assert news.location.endswith("lee_background.cor")
    assert (len(news.calibration), len(news.test)) == (148, 145)  # 300 articles, 7 verbatim repeats dropped
    assert news.n_chars["calibration"] > 150_000 and news.n_chars["test"] > 150_000
    assert not set(news.calibration["title"]) & set(news.test["title"])
    assert not set(news.calibration["story"]) & set(news.test["story"])
    assert not _shared_runs(news, 8)  # articles that share text (updated stories) are in one half
    assert news.sha256 == LEE_NEWS_SHA256
    assert load_corpus(TextConfig(source="news"), Cache(cache_dir)).sha256 == LEE_NEWS_SHA256  # from the cache


def test_news_calibration_disjoint_from_windows(news, tiny_model):
    _check_run_sized_disjoint(news, tiny_model.tokenizer)


@pytest.fixture(scope="module")
def austen(cache_dir):
    if austen_path() is None:
        pytest.skip(AUSTEN_MISSING)
    return load_corpus(TextConfig(source="austen"), Cache(cache_dir))


@needs_austen
def test_austen_split_by_chapter(austen):
    assert austen.source == AUSTEN and not austen.comparable_to_wikitext2
    assert austen.location == austen_path()
    assert (len(austen.calibration), len(austen.test)) == (134, 135)  # 269 chapters of six novels
    for split in (austen.calibration, austen.test):  # alternating chapters: every novel in both halves
        assert {title.split(", chapter")[0] for title in split["title"]} == set(AUSTEN_NOVELS.values())
    assert not set(austen.calibration["title"]) & set(austen.test["title"])
    assert austen.n_chars["calibration"] > 1_900_000 and austen.n_chars["test"] > 1_900_000
    assert austen.test["text"][0].startswith("The family of Dashwood had long been settled in Sussex.")
    headings = re.compile(r"^(chapter [0-9ivxlc]+|volume [ivx]+|the end|finis|a note on the text)$", re.I | re.M)
    assert not any(headings.search(text) for text in list(austen.test["text"]) + list(austen.calibration["text"]))
    assert not _shared_runs(austen, 12)
    expected = AUSTEN_SHA256.get(file_sha256(austen_path()))
    if expected:
        assert austen.sha256 == expected


@needs_austen
def test_austen_calibration_disjoint_from_windows(austen, tiny_model):
    _check_run_sized_disjoint(austen, tiny_model.tokenizer)


def test_missing_austen_package(compose, monkeypatch, tmp_path, cache_dir):
    """Without the Debian package: one line naming it and how to install it, before any model is loaded."""
    import qexp.data.text_sources
    from qexp.pipeline import validate

    monkeypatch.setattr(qexp.data.text_sources, "AUSTEN_DIRS", (str(tmp_path / "janeaustenr"),))
    with pytest.raises(InputError) as error:
        validate(compose(TINY + ["text=austen"]))
    assert str(error.value) == AUSTEN_MISSING
    with pytest.raises(InputError, match="^calibration.text=austen needs the Debian package r-cran-janeaustenr"):
        validate(compose(TINY + ["calibration.text=austen"]))
    validate(compose(TINY + ["quant=fp32", "calibration.text=austen"]))  # nothing calibrates: not needed
    with pytest.raises(InputError) as error:
        load_corpus(TextConfig(source="austen"), Cache(cache_dir))
    assert str(error.value) == AUSTEN_MISSING


def test_calibration_text_needs_text_calibration(compose):
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match="calibration.text=news applies to calibration=wikitext only"):
        validate(compose(TINY + ["calibration=prompt", "calibration.text=news"]))


def test_run_calibrates_on_another_text(compose, store_uri):
    """Evaluate on news, calibrate on the wiki text: both texts are recorded with the run."""
    from qexp.pipeline import run_experiment

    result = run_experiment(compose(TINY + ["text=news", "calibration.text=wikitext"]))
    tags = result.tags
    assert tags["text_source"] == LEE_NEWS and tags["text_sha256"] == LEE_NEWS_SHA256
    assert tags["calibration_text_source"] == GENSIM_EXCERPT
    assert tags["calibration_text_sha256"] == GENSIM_EXCERPT_SHA256
    run = MlflowClient(store_uri).get_run(result.run_id)
    params = run.data.params
    assert params["text.source"] == "news" and params["eval.text_source"] == LEE_NEWS
    assert params["calibration.text"] == "wikitext" and params["calibration.text_source"] == GENSIM_EXCERPT
    assert run.data.tags["calibration_text_source"] == GENSIM_EXCERPT
    inputs = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert {f"{LEE_NEWS}:test", f"{GENSIM_EXCERPT}:calibration"} <= inputs


def test_domain_shift_sweep_composes(compose):
    cfg = compose(["+sweep=domain_shift", "text=news", "calibration.text=wikitext"], tracked=False)
    assert (cfg.model.name, cfg.quant.name, cfg.backend.name) == ("smollm2_135m", "16a4w", "none")
    assert cfg.calibration.sampling.value == "spread" and cfg.tracking.sweep == "domain_shift"
    assert cfg.text.source.value == "news" and cfg.calibration.text.value == "wikitext"
