"""Text for calibration and evaluation, through `datasets`, as two disjoint splits.

WikiText-2 raw is used when it is available locally (text.wikitext_path, or the `datasets` cache): its train split
calibrates, its test split evaluates. Nothing can be downloaded here, so otherwise the English Wikipedia excerpt in
the gensim wheel is used, split by article (alternating) into calibration and test halves. Scores on it are not
comparable to published WikiText-2 numbers; the source is logged with every run and warned about.
"""

from __future__ import annotations

import bz2
import hashlib
import logging
import os
import re
from dataclasses import dataclass

from qexp.cache import Cache, file_sha256
from qexp.config import TextConfig
from qexp.errors import InputError

log = logging.getLogger("qexp")

WIKITEXT2 = "wikitext-2-raw-v1"
GENSIM_EXCERPT = "gensim-enwiki-excerpt"
_GENSIM_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_SPLIT_VERSION = 1  # bump when the gensim split rule or markup cleaning changes


@dataclass
class TextCorpus:
    calibration: "datasets.Dataset"  # noqa: F821 - column "text", one row per article / line
    test: "datasets.Dataset"  # noqa: F821
    source: str  # WIKITEXT2 or GENSIM_EXCERPT
    sha256: str  # of the text actually used (both splits)
    comparable_to_wikitext2: bool

    @property
    def n_chars(self) -> dict:
        return {"calibration": sum(map(len, self.calibration["text"])), "test": sum(map(len, self.test["text"]))}

    def joined(self, split: str) -> str:
        rows = self.calibration["text"] if split == "calibration" else self.test["text"]
        sep = "" if self.source == WIKITEXT2 else "\n\n"  # WikiText rows are lines that keep their "\n"
        return sep.join(rows)


def load_corpus(cfg: TextConfig, cache: Cache) -> TextCorpus:
    splits = _local_wikitext2(cfg.wikitext_path)
    if splits is not None:
        calibration, test = splits
        return TextCorpus(calibration, test, WIKITEXT2, _digest(calibration, test), True)
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
    return TextCorpus(calibration, test, GENSIM_EXCERPT, _digest(calibration, test), False)


def _digest(calibration, test) -> str:
    h = hashlib.sha256()
    for split in (calibration, test):
        for text in split["text"]:
            h.update(text.encode("utf-8"))
        h.update(b"\x00split\x00")
    return h.hexdigest()


def _local_wikitext2(path: str | None):
    import datasets

    if path:
        path = os.path.expanduser(path)
        if not os.path.exists(path):
            raise InputError(f"text.wikitext_path not found: {path}", "fix the path or unset it")
        try:
            data = datasets.load_from_disk(path)
        except Exception:  # noqa: BLE001 - not a saved dataset: try a data folder (parquet, text, ...)
            try:
                data = datasets.load_dataset(path)
            except Exception as exc:  # noqa: BLE001
                raise InputError(f"cannot read WikiText-2 from {path}: {exc}", "check the folder") from exc
        if "train" not in data or "test" not in data:
            return None
        return data["train"], data["test"]
    # The datasets cache (populated on a machine with network access); offline, so this never downloads.
    for name in ("Salesforce/wikitext", "wikitext"):
        try:
            data = datasets.load_dataset(name, WIKITEXT2)
            log.info("WikiText-2 raw found in the datasets cache (%s)", name)
            return data["train"], data["test"]
        except Exception:  # noqa: BLE001 - not cached
            continue
    return None


def gensim_excerpt_path() -> str:
    import gensim

    return os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", _GENSIM_FILE)


def _gensim_excerpt(cache: Cache):
    import datasets

    path = gensim_excerpt_path()
    if not os.path.isfile(path):
        raise InputError("the gensim Wikipedia excerpt is missing", "run `make setup` (installs gensim)")
    key = f"{file_sha256(path)[:24]}-v{_SPLIT_VERSION}"

    def build(tmp) -> dict:
        articles = _parse_wiki_dump(path)
        dataset = datasets.DatasetDict(
            {
                "calibration": datasets.Dataset.from_list(articles[1::2]),
                "test": datasets.Dataset.from_list(articles[0::2]),
            }
        )
        dataset.save_to_disk(str(tmp / "dataset"))
        return {"articles": len(articles), "source": path}

    entry, _ = cache.get_or_build("text", key, build)
    data = datasets.load_from_disk(str(entry / "dataset"))
    return data["calibration"], data["test"]


def _parse_wiki_dump(path: str) -> list[dict]:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.BZ2File(path) as dump:
        for title, markup, page_id in extract_pages(dump):
            if markup.lstrip().lower().startswith("#redirect"):
                continue
            text = _clean(filter_wiki(markup))
            if len(text) > 200:
                articles.append({"title": title, "page_id": str(page_id), "text": text})
    return articles


def _clean(text: str) -> str:
    text = re.sub(r"'{2,}", "", text)  # bold/italic quotes that filter_wiki leaves
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()
