"""Text for calibration and evaluation, through `datasets`, as two disjoint splits. `text.source` picks it:

- wikitext: WikiText-2 raw when it is available locally (text.wikitext_path, or the `datasets` cache): its train
  split calibrates, its test split evaluates. Nothing can be downloaded here, so otherwise the English Wikipedia
  excerpt in the gensim wheel is used, split by article (alternating) into calibration and test halves. Scores on it
  are not comparable to published WikiText-2 numbers; the source is logged with every run and warned about.
- news: the 300 Australian Broadcasting Corporation news articles of the Lee corpus in gensim's test data
  (lee_background.cor, one article a line), split by story (alternating): the 7 articles repeated verbatim are kept
  once, and articles that share a run of 8 words (a story updated, or appended to another) are one story.
- austen: Jane Austen's six novels from the Debian package r-cran-janeaustenr (an R lazy-load database of one
  character vector of lines per novel, read with the `rdata` package, without R), cut into chapters and split by
  chapter (alternating over the novels in publication order, so both halves hold every novel). Front matter,
  volume headings, "THE END" and an editor's note are dropped; hard-wrapped lines are joined into paragraphs.

Every split is a list of documents (articles, chapters) whose rows go wholly to one half, so no text is in both.
Where each source's files are and how its documents are read: qexp/data/text_sources.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

from qexp.cache import Cache, file_sha256
from qexp.core.config import CalibrationKind, TextConfig, TextSource
from qexp.data.text_sources import (_AUSTEN_SPLIT_VERSION, _NEWS_SPLIT_VERSION, _SPLIT_VERSION, AUSTEN,
                                     AUSTEN_PACKAGE, GENSIM_EXCERPT, LEE_NEWS, WIKITEXT2, _local_wikitext2,
                                     _parse_wiki_dump, _read_austen, _read_news, austen_path, gensim_excerpt_path,
                                     news_path)
from qexp.core.errors import ConfigError, InputError

log = logging.getLogger("qexp")


@dataclass
class TextCorpus:
    calibration: "datasets.Dataset"  # noqa: F821 - column "text", one row per article / line
    test: "datasets.Dataset"  # noqa: F821
    source: str  # WIKITEXT2, GENSIM_EXCERPT, LEE_NEWS or AUSTEN
    sha256: str  # of the text actually used (both splits)
    comparable_to_wikitext2: bool
    location: str = ""  # where the text was read from (a file or folder; a dataset name in the datasets cache)

    @property
    def n_chars(self) -> dict:
        return {"calibration": sum(map(len, self.calibration["text"])), "test": sum(map(len, self.test["text"]))}

    def joined(self, split: str) -> str:
        rows = self.calibration["text"] if split == "calibration" else self.test["text"]
        sep = "" if self.source == WIKITEXT2 else "\n\n"  # WikiText rows are lines that keep their "\n"
        return sep.join(rows)


def load_corpus(cfg: TextConfig, cache: Cache, source: TextSource | str | None = None) -> TextCorpus:
    """The text `source` names (default: cfg.source); cfg's wikitext settings apply to source=wikitext."""
    source = TextSource(source if source is not None else cfg.source)
    if source == TextSource.news:
        path = news_path()
        calibration, test = _alternating(cache, path, "news-", _NEWS_SPLIT_VERSION, _read_news, "the Lee news corpus")
        return TextCorpus(calibration, test, LEE_NEWS, _digest(calibration, test), False, path)
    if source == TextSource.austen:
        path = austen_path()
        if path is None:
            raise InputError(f"text=austen needs {AUSTEN_PACKAGE}")
        calibration, test = _alternating(cache, path, "austen-", _AUSTEN_SPLIT_VERSION, _read_austen, "janeaustenr")
        return TextCorpus(calibration, test, AUSTEN, _digest(calibration, test), False, path)
    splits = _local_wikitext2(cfg.wikitext_path)
    if splits is not None:
        calibration, test = splits
        location = os.path.expanduser(cfg.wikitext_path) if cfg.wikitext_path else f"datasets-cache:{WIKITEXT2}"
        return TextCorpus(calibration, test, WIKITEXT2, _digest(calibration, test), True, location)
    if cfg.wikitext_path:
        raise InputError(
            f"text.wikitext_path={cfg.wikitext_path} does not hold WikiText-2 raw (train and test splits)",
            "point it at a folder saved with DatasetDict.save_to_disk or holding the parquet files",
        )
    if not cfg.allow_fallback:
        raise InputError(
            "WikiText-2 raw is not available locally and text.allow_fallback=false",
            "set text.wikitext_path, or allow the gensim Wikipedia excerpt",
        )
    calibration, test = _gensim_excerpt(cache)
    log.warning(
        "WikiText-2 is not available offline: using the Wikipedia excerpt shipped in gensim. Perplexities on it "
        "are NOT comparable to published WikiText-2 numbers."
    )
    return TextCorpus(calibration, test, GENSIM_EXCERPT, _digest(calibration, test), False, gensim_excerpt_path())


def calibration_corpus(cfg: TextConfig, text: TextSource | str | None, corpus: TextCorpus,
                       cache: Cache) -> TextCorpus:
    """The text calibration samples come from: `calibration.text`, or the evaluation text (`corpus`) when null."""
    if text is None or TextSource(text) == TextSource(cfg.source):
        return corpus
    return load_corpus(cfg, cache, source=text)


def check_texts(cfg: TextConfig, calibration, needs_calibration: bool) -> None:
    """Cheap checks before a run (pipeline.validate): the texts it names exist, calibration.text fits its kind."""
    sources = [("text", cfg.source)]
    if calibration.text is not None:
        if CalibrationKind(calibration.kind) != CalibrationKind.wikitext:
            raise ConfigError(f"calibration.text={TextSource(calibration.text).value} applies to calibration=wikitext "
                              f"only (calibration={CalibrationKind(calibration.kind).value})",
                              "drop calibration.text, or use calibration=wikitext")
        if needs_calibration:
            sources.append(("calibration.text", calibration.text))
    for key, source in sources:
        if TextSource(source) == TextSource.austen and austen_path() is None:
            raise InputError(f"{key}=austen needs {AUSTEN_PACKAGE}")


def _digest(calibration, test) -> str:
    h = hashlib.sha256()
    for split in (calibration, test):
        for text in split["text"]:
            h.update(text.encode("utf-8"))
        h.update(b"\x00split\x00")
    return h.hexdigest()


def _gensim_excerpt(cache: Cache):
    path = gensim_excerpt_path()
    return _alternating(cache, path, "", _SPLIT_VERSION, _parse_wiki_dump, "the gensim Wikipedia excerpt")


def _alternating(cache: Cache, path: str, prefix: str, version: int, read, what: str):
    """Documents read from `path` (one row each, in order), alternately into the test (even) and calibration (odd)
    halves, or by their "story" number when they have one; cached as a saved DatasetDict keyed by the file's sha256
    and the split rule's version."""
    import datasets

    if not os.path.isfile(path):
        raise InputError(f"{what} is missing ({path})", "run `make setup` (installs gensim)")
    key = f"{prefix}{file_sha256(path)[:24]}-v{version}"

    def build(tmp) -> dict:
        articles = read(path)
        # Rows of one story (news articles that share text) go to the same half: stories alternate, not rows.
        odd = [article.get("story", i) % 2 for i, article in enumerate(articles)]
        dataset = datasets.DatasetDict(
            {
                "calibration": datasets.Dataset.from_list([a for a, o in zip(articles, odd) if o]),
                "test": datasets.Dataset.from_list([a for a, o in zip(articles, odd) if not o]),
            }
        )
        dataset.save_to_disk(str(tmp / "dataset"))
        return {"articles": len(articles), "source": path}

    entry, _ = cache.get_or_build("text", key, build)
    data = datasets.load_from_disk(str(entry / "dataset"))
    return data["calibration"], data["test"]
