"""Tasks qexp builds from the test halves of the texts it ships, as lm-eval task folders (YAML + JSONL).

No public task data can be downloaded here, so qexp makes two tasks in the styles quantization papers report, from
the same test halves its perplexity windows come from (never the calibration halves: disjoint from every calibration
sample by construction). They are *not* LAMBADA or HellaSwag and their numbers are not comparable to published ones:

- `qexp_lastword_<text>` (LAMBADA's style): a passage of consecutive sentences of one paragraph; predict its last
  word. As LAMBADA keeps passages whose word a reader can get from the whole passage but not from the last sentence
  alone, an item's word must occur earlier in the passage, outside the last sentence, and not be a function word.
  lm-eval's `acc` (every token of the word greedy) and `perplexity` of the word.
- `qexp_choice_<text>`: a passage and four candidate next sentences: the true one and three of similar length from
  other paragraphs of the same document (same topic and names), or from other documents when it has too few;
  lm-eval's `acc` and `acc_norm`.

Deterministic: the same text and the same `TASK_VERSION` give the same files (seeded sampling); the folder's
manifest records each task's sha256, and runs log it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import yaml

TASK_VERSION = 2  # bump when the items or the task files change: the tasks' names stay, their hashes change
SEED = 1234
KINDS = ("lastword", "choice")
TEXTS = ("wikitext", "news", "austen")
LASTWORD_ITEMS = 1000
CHOICE_ITEMS = 500
PASSAGE_WORDS = (25, 90)  # words in a last-word passage (LAMBADA's average is ~75; shorter costs less to score)
CHOICE_CONTEXT_WORDS = (25, 60)
CHOICE_SENTENCE_WORDS = (6, 30)
DISTRACTORS = 3

# Function words never make a last-word item (they are guessable from grammar alone).
_FUNCTION_WORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on once
only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves one two three said says mr mrs miss
""".split())

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)]*\s+(?=[\"'\u201c\u2018(]?[A-Z])")
_ABBREVIATION = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Gen|Col|Capt|Lt|Sgt|Rev|Gov|Sen|Rep|No|vs|Mt|Ft)|"
                           r"\b[A-Z])\.$")  # "Mr." and initials do not end a sentence
_LAST_WORD = re.compile(r"([A-Za-z]+)([.!?][\"'\u201d\u2019)]*)$")
_WORD = re.compile(r"[A-Za-z]+")


def task_name(kind: str, text: str) -> str:
    return f"qexp_{kind}_{text}"


def parse_task_name(name: str):
    """(kind, text) of a qexp task name, or None for any other task."""
    parts = name.split("_")
    if len(parts) == 3 and parts[0] == "qexp" and parts[1] in KINDS and parts[2] in TEXTS:
        return parts[1], parts[2]
    return None


def _paragraph_sentences(documents: List[str]) -> List[Tuple[int, List[str]]]:
    """(document index, its sentences) for every paragraph of every document."""
    out = []
    for d, doc in enumerate(documents):
        for paragraph in re.split(r"\n\s*\n|\n", doc):
            paragraph = " ".join(paragraph.split())
            if paragraph:
                out.append((d, _sentences(paragraph)))
    return out


def _sentences(paragraph: str) -> List[str]:
    sentences: List[str] = []
    for piece in _SENTENCE_END.split(paragraph):
        if sentences and _ABBREVIATION.search(sentences[-1]):
            sentences[-1] += " " + piece
        elif piece:
            sentences.append(piece)
    return sentences


def _words(text: str) -> int:
    return len(text.split())


def lastword_items(documents: List[str], limit: int = LASTWORD_ITEMS) -> List[dict]:
    candidates = []
    low, high = PASSAGE_WORDS
    for _, sentences in _paragraph_sentences(documents):
        i = 0
        while i < len(sentences):
            # the shortest passage from sentence i whose last sentence ends the passage within the word range
            n, taken = 0, None
            for j in range(i, len(sentences)):
                n += _words(sentences[j])
                if n > high:
                    break
                if n >= low and j > i:
                    item = _lastword_item(sentences[i: j + 1])
                    if item is not None:
                        taken = (j, item)
                        break
            if taken is None:
                i += 1
                continue
            candidates.append(taken[1])
            i = taken[0] + 1  # passages never overlap
    return _sample(candidates, limit)


def _lastword_item(sentences: List[str]):
    match = _LAST_WORD.search(sentences[-1])
    if match is None:
        return None
    word = match.group(1)
    if len(word) < 3 or word.lower() in _FUNCTION_WORDS:
        return None
    earlier = {w.lower() for w in _WORD.findall(" ".join(sentences[:-1]))}
    if word.lower() not in earlier:
        return None
    passage = " ".join(sentences)[: -len(match.group(0))] + word
    context = passage[: -len(word)].rstrip()
    if not context or context[-1] in "-\u2014":
        return None
    return {"context": context, "target": word}


def choice_items(documents: List[str], limit: int = CHOICE_ITEMS) -> List[dict]:
    """Distractors come from the passage's own document, other paragraphs (same topic and names: harder than
    random sentences), or from other documents when its document has too few."""
    paragraphs = _paragraph_sentences(documents)
    low, high = CHOICE_SENTENCE_WORDS
    pool: Dict[int, List[Tuple[int, str]]] = {}  # by document: (paragraph index, sentence) that may be a distractor
    for p, (d, sentences) in enumerate(paragraphs):
        pool.setdefault(d, []).extend((p, s) for s in sentences if low <= _words(s) <= high)
    candidates = []
    c_low, c_high = CHOICE_CONTEXT_WORDS
    for p, (d, sentences) in enumerate(paragraphs):
        i = 0
        while i < len(sentences) - 1:
            end, n = None, 0
            for j in range(i, len(sentences) - 1):
                n += _words(sentences[j])
                if n > c_high:
                    break
                if n >= c_low and low <= _words(sentences[j + 1]) <= high:
                    end = j
                    break
            if end is None:
                i += 1
                continue
            candidates.append((d, p, " ".join(sentences[i: end + 1]), sentences[end + 1]))
            i = end + 2  # items never overlap
    chosen = _sample(candidates, limit)
    rng = random.Random(SEED + 1)
    items = []
    for d, p, context, true_next in chosen:
        length = len(true_next)
        similar = lambda sentence: 0.6 * length <= len(sentence) <= 1.5 * length  # noqa: E731
        own = sorted({s for q, s in pool[d] if q != p and similar(s) and s != true_next})
        if len(own) >= DISTRACTORS:
            distractors = rng.sample(own, DISTRACTORS)
        else:
            others = sorted({s for e, sentences in pool.items() if e != d for _, s in sentences if similar(s)})
            if len(others) < DISTRACTORS:
                raise ValueError(f"too few sentences of ~{length} characters in the text for distractors")
            distractors = rng.sample(others, DISTRACTORS)
        gold = rng.randrange(DISTRACTORS + 1)
        items.append({"context": context, "choices": distractors[:gold] + [true_next] + distractors[gold:],
                      "gold": gold})
    return items


def _sample(candidates: list, limit: int) -> list:
    """`limit` candidates by a seeded draw, in text order (all of them when there are fewer)."""
    if len(candidates) <= limit:
        return list(candidates)
    keep = sorted(random.Random(SEED).sample(range(len(candidates)), limit))
    return [candidates[i] for i in keep]


# lm-eval's task config of each kind, besides the name, data and metadata (lm-eval's lambada and multiple-choice
# conventions: a loglikelihood target carries its own leading space; choices get target_delimiter)
_TASK = {
    "lastword": {"output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": "{{' ' + target}}",
                 "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                 {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "choice": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "choices",
               "doc_to_target": "gold", "target_delimiter": " ",
               "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                               {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]},
}


def template_hash() -> str:
    """What the task files say besides the items (how a request is formed): part of every cache key of results."""
    return hashlib.sha256(json.dumps(_TASK, sort_keys=True).encode()).hexdigest()[:16]


def build_items(kind: str, documents: List[str]) -> bytes:
    """The task's items as JSONL bytes (their sha256 names the task's content)."""
    items = lastword_items(documents) if kind == "lastword" else choice_items(documents)
    return "".join(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n" for item in items).encode()


def write_task_yaml(kind: str, text: str, data_path: Path, sha256: str, described: str, root: Path) -> Path:
    """lm-eval's task file for items at `data_path`, in `root/<name>/` (pass `root` as an include path)."""
    name = task_name(kind, text)
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    config = {"task": name, "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": str(Path(data_path).resolve())}}, "test_split": "test",
              **_TASK[kind], "metadata": {"version": TASK_VERSION, "sha256": sha256, "built_from": described}}
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return path


@dataclass
class BuiltTask:
    name: str
    data: Path  # data.jsonl
    sha256: str  # of the items (the JSONL bytes)
    n_items: int
    described: str  # the text's source and sha256


def write_task(kind: str, text: str, documents: List[str], source: str, text_sha256: str, root: Path) -> BuiltTask:
    """A self-contained task folder `root/<name>/` (YAML + data.jsonl) built from `documents` (a test half)."""
    data = build_items(kind, documents)
    name = task_name(kind, text)
    (root / name).mkdir(parents=True, exist_ok=True)
    path = root / name / "data.jsonl"
    path.write_bytes(data)
    sha256 = hashlib.sha256(data).hexdigest()
    described = describe(source, text_sha256)
    write_task_yaml(kind, text, path, sha256, described, root)
    return BuiltTask(name, path, sha256, data.count(b"\n"), described)


def describe(source: str, text_sha256: str) -> str:
    return f"{source} test half, text sha256 {text_sha256[:16]}"
