"""Calibration data: token sequences fed through the prepared model before convert_pt2e.

Three kinds: `wikitext` (samples of the calibration split, never the evaluation split), `prompt` (literal strings,
special tokens kept), `chat` (conversations rendered with the tokenizer's chat template). `check_disjoint` then
verifies that no calibration sample shares a long token n-gram with the evaluation windows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from typing import List

import numpy as np

from qexp.core.config import CalibrationConfig, CalibrationKind, CalibrationSampling
from qexp.core.errors import ConfigError, InputError
from qexp.data.text import TextCorpus
from qexp.data.windows import Windows, encode_prefix
from qexp.models.tokenizer import Tokenizer

log = logging.getLogger("qexp")

BUILTIN_CHATS = str(resources.files("qexp") / "data" / "chat_samples.json")  # calibration=chat without chat_path
OVERLAP_NGRAM = 24  # tokens; long enough that a shared n-gram means shared text, not a common phrase


@dataclass
class CalibrationSet:
    samples: List[List[int]]
    kind: str
    description: str  # where the samples came from

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for sample in self.samples:
            h.update(np.asarray(sample, dtype=np.int64).tobytes())
            h.update(b"|")
        return h.hexdigest()

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


def build_calibration(
    cfg: CalibrationConfig, corpus: TextCorpus, tokenizer: Tokenizer, add_bos: bool, max_len: int
) -> CalibrationSet:
    if cfg.limit < 1:
        raise InputError(f"calibration.limit={cfg.limit}: calibration data is empty", "use calibration.limit>=1")
    if cfg.seq_len > max_len:
        raise ConfigError(
            f"calibration.seq_len={cfg.seq_len} exceeds the static graph context export.max_context_len={max_len}",
            "lower calibration.seq_len or raise export.max_context_len",
        )
    prefix = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    if cfg.kind == CalibrationKind.wikitext:
        text, body = corpus.joined("calibration"), cfg.seq_len - len(prefix)
        if cfg.sampling == CalibrationSampling.spread:
            samples = _spread_samples(text, tokenizer, body, cfg.limit)
            description = f"{corpus.source}:calibration split, {cfg.limit} spread samples"
        else:
            samples = _text_samples(text, tokenizer, body, cfg.limit)
            description = f"{corpus.source}:calibration split"
    elif cfg.kind == CalibrationKind.prompt:
        prompts = [p for p in cfg.prompts if p and p.strip()]
        if not prompts:
            raise InputError("calibration=prompt but calibration.prompts is empty", "give one or more prompt strings")
        samples = [tokenizer.encode(p)[: cfg.seq_len - len(prefix)] for p in prompts[: cfg.limit]]
        description = f"{len(samples)} prompt(s)"
    else:  # chat
        path = cfg.chat_path or BUILTIN_CHATS
        conversations = _read_chats(path)[: cfg.limit]
        texts = [tokenizer.render_chat(c["messages"], cfg.chat_template) for c in conversations]
        # A rendered template already starts with its own BOS-like token where the model has one.
        prefix = []
        samples = [tokenizer.encode(t)[: cfg.seq_len] for t in texts]
        description = f"{len(samples)} conversation(s) from {os.path.basename(path)}"
    samples = [prefix + s for s in samples if s]
    if not samples or all(len(s) <= len(prefix) for s in samples):
        raise InputError(f"calibration data is empty ({description})", "check the calibration text, prompts or chats")
    log.info("calibration: %d samples, %d tokens (%s)", len(samples), sum(map(len, samples)), description)
    return CalibrationSet(samples=samples, kind=cfg.kind.value, description=description)


def _text_samples(text: str, tokenizer: Tokenizer, body: int, limit: int) -> List[List[int]]:
    needed = body * limit
    ids = encode_prefix(text, tokenizer, needed, chunk_chars=4 * needed)
    if not ids:
        raise InputError("the calibration text is empty", "check the text source")
    return [ids[i : i + body] for i in range(0, min(len(ids), needed), body)]


def _spread_samples(text: str, tokenizer: Tokenizer, body: int, limit: int) -> List[List[int]]:
    """One sample of `body` tokens from each of `limit` evenly spaced paragraph starts of the text, so the samples
    cover many articles instead of the first one."""
    samples = []
    for i in range(limit):
        start = text.find("\n\n", i * len(text) // limit)
        start = 0 if start < 0 or i == 0 else start + 2
        ids = encode_prefix(text[start:], tokenizer, body, chunk_chars=4 * body)[:body]
        if ids:
            samples.append(ids)
    if not samples:
        raise InputError("the calibration text is empty", "check the text source")
    return samples


def _read_chats(path: str) -> list:
    if not os.path.isfile(path):
        raise InputError(f"calibration.chat_path not found: {path}", "pass a JSON file of {'messages': [...]} items")
    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"calibration.chat_path {path} is not valid JSON ({exc})", "fix the file") from exc
    data = [data] if isinstance(data, dict) else data
    if not isinstance(data, list) or not all(isinstance(c, dict) and c.get("messages") for c in data):
        raise InputError(f"{path}: expected a list of {{\"messages\": [...]}} objects", "fix the file")
    return data


def check_disjoint(calibration: CalibrationSet, windows: Windows, n: int = OVERLAP_NGRAM) -> None:
    """Fail if any calibration sample shares an n-token run with the evaluation windows."""
    check_rows_disjoint(calibration.samples, windows, "calibration sample {index} (" + calibration.description + ")",
                        "calibrate on text disjoint from the evaluation text", n)


def check_rows_disjoint(rows, windows: Windows, what: str, fix: str, n: int = OVERLAP_NGRAM) -> None:
    """Fail if any of `rows` (token id sequences a run fits to: calibration samples, QAT's training text) shares an
    n-token run with the evaluation windows. `what` names the offending row, with `{index}` for its position. The
    two halves of a text share no document, but a text can repeat a passage across documents."""
    eval_grams = set()
    for row in windows.ids:
        row = row[windows.first_target :]
        for i in range(0, len(row) - n + 1):
            eval_grams.add(row[i : i + n].tobytes())
    for index, sample in enumerate(rows):
        arr = np.asarray(sample, dtype=np.int64)
        name = what.replace("{index}", str(index))
        size = min(n, len(arr))
        for i in range(0, len(arr) - size + 1):
            gram = arr[i : i + size]
            if size < n:  # a short sample: look for it inside the windows directly
                if any(_contains(row, gram) for row in windows.ids):
                    raise ConfigError(f"{name} occurs verbatim in the evaluation windows", fix)
                break
            if gram.tobytes() in eval_grams:
                raise ConfigError(f"{name} shares a {n}-token run with the evaluation windows", fix)


def _contains(row: np.ndarray, gram: np.ndarray) -> bool:
    m = len(gram)
    return any(np.array_equal(row[i : i + m], gram) for i in range(len(row) - m + 1))
