"""Where each text source's documents come from and how they are read (qexp/data/text.py splits and caches them):
WikiText-2 raw (a folder or the `datasets` cache) and the gensim Wikipedia excerpt, gensim's Lee news corpus, and
janeaustenr's novels read from its R lazy-load database without R.
"""

from __future__ import annotations

import bz2
import logging
import os
import re

from qexp.core.errors import InputError

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
