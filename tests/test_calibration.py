"""Calibration data kinds, and the check that calibration text is disjoint from evaluation text."""

from __future__ import annotations

import json

import pytest

from helpers import TINY
from qexp.data.calibration import build_calibration, check_disjoint
from qexp.core.errors import ConfigError, InputError
from qexp.data.windows import make_windows


def _build(compose, tiny_model, corpus, overrides):
    cfg = compose(TINY + overrides)
    return build_calibration(cfg.calibration, corpus, tiny_model.tokenizer, True, cfg.export.max_context_len)


def test_wikitext_samples(compose, tiny_model, corpus):
    calibration = _build(compose, tiny_model, corpus, ["calibration.limit=4"])
    assert len(calibration.samples) == 4
    assert all(len(s) == 64 and s[0] == tiny_model.tokenizer.bos_id for s in calibration.samples)


def test_prompt_samples_keep_text(compose, tiny_model, corpus):
    calibration = _build(compose, tiny_model, corpus, ["calibration=prompt", "calibration.prompts=[hello world]"])
    assert tiny_model.tokenizer.decode(calibration.samples[0][1:]) == "hello world"


def test_chat_samples_use_template(compose, tiny_model, corpus, tmp_path):
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([{"messages": [{"role": "user", "content": "What is 1+1?"}]}]))
    calibration = _build(compose, tiny_model, corpus, ["calibration=chat", f"calibration.chat_path={chats}"])
    text = tiny_model.tokenizer.decode(calibration.samples[0])
    assert "user: What is 1+1?" in text


def test_shipped_chat_samples(compose, tiny_model, corpus):
    calibration = _build(compose, tiny_model, corpus, ["calibration=chat", "calibration.limit=3"])
    assert len(calibration.samples) == 3


def test_empty_prompts_rejected(compose, tiny_model, corpus):
    with pytest.raises(InputError, match="prompts is empty"):
        _build(compose, tiny_model, corpus, ["calibration=prompt", "calibration.prompts=[]"])


def test_zero_limit_rejected(compose, tiny_model, corpus):
    with pytest.raises(InputError, match="empty"):
        _build(compose, tiny_model, corpus, ["calibration.limit=0"])


def test_bad_chat_file(compose, tiny_model, corpus, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        _build(compose, tiny_model, corpus, ["calibration=chat", f"calibration.chat_path={bad}"])


def test_task_calibration_is_disjoint_from_eval(compose, tiny_model, corpus):
    calibration = _build(compose, tiny_model, corpus, ["calibration.limit=8"])
    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, 64, 8, True)
    check_disjoint(calibration, windows)  # no exception


def test_overlap_is_detected(compose, tiny_model, corpus):
    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, 64, 4, True)
    leaked = tiny_model.tokenizer.decode(windows.ids[2][10:50])
    calibration = _build(compose, tiny_model, corpus, ["calibration=prompt", f"calibration.prompts=['{leaked}']"])
    with pytest.raises(ConfigError, match="evaluation windows"):
        check_disjoint(calibration, windows)
