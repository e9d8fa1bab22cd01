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
"""

from __future__ import annotations

import bz2
import hashlib
import logging
import os
import re
from dataclasses import dataclass

from qexp.cache import Cache, file_sha256
from qexp.config import CalibrationKind, TextConfig, TextSource
from qexp.errors import ConfigError, InputError

log = logging.getLogger("qexp")

WIKITEXT2 = "wikitext-2-raw-v1"
GENSIM_EXCERPT = "gensim-enwiki-excerpt"
_GENSIM_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_SPLIT_VERSION = 1  # bump when the gensim split rule or markup cleaning changes
LEE_NEWS = "gensim-lee-news"
_LEE_FILE = "lee_background.cor"
_NEWS_SPLIT_VERSION = 1  # bump when the news split rule changes
_STORY_WORDS = 8  # news articles sharing a run of this many words are one story (kept in one half)
AUSTEN = "janeaustenr"
# Where Debian's r-cran-janeaustenr puts the package (R's site library; /usr/local for a CRAN install).
AUSTEN_DIRS = ("/usr/lib/R/site-library/janeaustenr", "/usr/local/lib/R/site-library/janeaustenr")
AUSTEN_PACKAGE = "the Debian package r-cran-janeaustenr (apt-get install r-cran-janeaustenr)"
_AUSTEN_SPLIT_VERSION = 1  # bump when the chapter cutting, cleaning or split rule changes
# janeaustenr's objects in publication order (the order of its austen_books()), with the books' titles.
AUSTEN_NOVELS = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


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


# ---------------------------------------------------------------- news: gensim's Lee corpus
def news_path() -> str:
    import gensim

    return os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", _LEE_FILE)


def _read_news(path: str) -> list[dict]:
    """The articles, each once (7 of the 300 are repeated verbatim), numbered by story: articles that share a run of
    _STORY_WORDS words (a story updated, or appended to another) are one story, so they land in the same half."""
    articles, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f):
            text = line.strip()
            if text and text not in seen:
                seen.add(text)
                articles.append({"title": f"article {line_number}", "text": text})
    parent = list(range(len(articles)))  # union-find over articles sharing a word run

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    first_seen: dict = {}
    for i, article in enumerate(articles):
        words = article["text"].split()
        for j in range(len(words) - _STORY_WORDS + 1):
            earlier = first_seen.setdefault(tuple(words[j : j + _STORY_WORDS]), i)
            if earlier != i:
                parent[root(i)] = root(earlier)
    stories: dict = {}
    for i, article in enumerate(articles):
        article["story"] = stories.setdefault(root(i), len(stories))
    return articles


# ---------------------------------------------------------------- austen: janeaustenr's data, read without R
def austen_path() -> str | None:
    """The janeaustenr data (an R lazy-load database: Rdata.rdb with its index Rdata.rdx), or None if missing."""
    for folder in AUSTEN_DIRS:
        path = os.path.join(folder, "data", "Rdata.rdb")
        if os.path.isfile(path) and os.path.isfile(path[:-1] + "x"):
            return path
    return None


_CHAPTER = re.compile(r"chapter\s+([0-9]+|[ivxlc]+)\.?", re.IGNORECASE)
_NOT_TEXT = re.compile(r"volume\s+[ivx]+|\(end of volume \w+\.?\)|the end|finis", re.IGNORECASE)
_EDITORS_NOTE = re.compile(r"a note on the text", re.IGNORECASE)  # Northanger Abbey ends with the edition's note


def _read_austen(path: str) -> list[dict]:
    novels = _read_lazyload_db(path)
    missing = set(AUSTEN_NOVELS) - set(novels)
    if missing:
        raise InputError(f"{path} lacks {', '.join(sorted(missing))}", "reinstall r-cran-janeaustenr")
    return [
        {"title": f"{title}, chapter {number}", "text": "\n\n".join(paragraphs)}
        for name, title in AUSTEN_NOVELS.items()
        for number, paragraphs in enumerate(_chapters(novels[name]), start=1)
    ]


def _chapters(lines: list[str]) -> list[list[str]]:
    """A novel's lines -> its chapters' paragraphs (hard-wrapped lines joined with a space; a blank line ends a
    paragraph). Text before the first chapter heading (title page, author's advertisement) is dropped, and so is
    everything from an editor's note on."""
    chapters: list[list[str]] = []
    paragraph: list[str] = []
    lines = [str(line).strip() for line in lines]
    end = next((i for i, line in enumerate(lines) if _EDITORS_NOTE.fullmatch(line)), len(lines))
    for line in lines[:end] + [""]:
        heading = _CHAPTER.fullmatch(line)
        if heading or not line or _NOT_TEXT.fullmatch(line):
            if paragraph and chapters:
                chapters[-1].append(" ".join(paragraph))
            paragraph = []
            if heading:
                chapters.append([])
            continue
        paragraph.append(line)
    return [c for c in chapters if c]


def _read_lazyload_db(path: str) -> dict[str, list[str]]:
    """The character vectors of an R lazy-load database (`data/Rdata.rdb`, index `Rdata.rdx`), by object name.

    The index is a gzip-compressed serialized R list whose `variables` maps each name to (offset, length) in the
    .rdb; each such block is a 4-byte big-endian length and the compressed serialization of the object (zlib, as R
    writes by default; or a type byte '0', 'Z', '2', 'X': none, zlib, bzip2, xz). `rdata` parses serializations."""
    import gzip

    with open(path[:-1] + "x", "rb") as f:
        index = _unserialize(gzip.decompress(f.read()))
    with open(path, "rb") as f:
        blob = f.read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        vector = _unserialize(_decompress(blob[int(offset) : int(offset) + int(length)]))
        out[str(name)] = [s if isinstance(s, str) else "" for s in vector]  # NA_character_ as an empty line
    return out


def _decompress(block: bytes) -> bytes:
    import bz2
    import lzma
    import zlib

    kind, body = block[4:5], block[5:]
    if kind == b"0":
        return body
    if kind == b"2":
        return bz2.decompress(body)
    if kind == b"X":
        return lzma.decompress(body)
    return zlib.decompress(body if kind == b"Z" else block[4:])


def _unserialize(data: bytes):
    import warnings

    try:
        import rdata
    except ImportError as exc:
        raise InputError("reading the Austen novels needs the `rdata` package", "run `make setup`") from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns that raw serialized data has no file-type header
        return rdata.conversion.convert(rdata.parser.parse_data(data))


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
