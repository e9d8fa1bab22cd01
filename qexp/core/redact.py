"""Secrets stay out of the store: credentials in a URI (`http://user:PASSWORD@host`, `?token=...`) and the values of
settings named like a secret (`token`, `*_token`, `*password*`, `*secret*`, `*api_key*`) are replaced by `***` in
everything qexp writes: params, tags, config.yaml, the sweep's command, overrides and log lines."""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"
# `token` only as a word of the name (hf_token, access_token), never inside one: `tokens`, `eval_tokens` and
# `tokenizer` are budgets and paths a run must keep readable; the others wherever they appear
_SECRET_WORD = r"(?<![a-z0-9])token(?![a-z0-9])|password|passwd|secret|api_?key|credential"
SECRET_NAME = re.compile(_SECRET_WORD, re.IGNORECASE)
# `name=value` where the name looks like a secret: overrides, query strings, log lines
_ASSIGNMENT = re.compile(rf"(?P<key>[\w.+~-]*(?:{_SECRET_WORD})[\w.-]*)=(?P<value>[^\s'\"&]+)", re.IGNORECASE)
# user:password@ after a scheme, also as Hydra prints overrides (`http\://alice\:PW@host`, colons escaped)
_USERINFO = re.compile(r"(?P<user>://[^\s/@:'\"\\]+)(?P<sep>\\?:)[^\s/@'\"]+@")


def redact_text(text: str) -> str:
    """URIs with credentials and `name=value` assignments of secret-named settings, anywhere in a text."""
    text = _USERINFO.sub(lambda m: f"{m.group('user')}{m.group('sep')}{MASK}@", text)
    return _ASSIGNMENT.sub(lambda m: f"{m.group('key')}={MASK}", text)


def redact(obj: Any, key: str = "") -> Any:
    """A copy of a config container (dicts, lists, scalars) with secrets masked."""
    if isinstance(obj, dict):
        return {k: redact(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, key) for v in obj)
    if isinstance(obj, str):
        return MASK if SECRET_NAME.search(key) and obj else redact_text(obj)
    return obj


def mask_log_records() -> None:
    """Mask secrets in every log record as it is created, whatever logger or handler (Hydra's launcher logs each
    job's overrides, and reconfigures its handlers for every job: a record factory outlives that)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "qexp_masks", False):
        return

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
            return record
        masked = redact_text(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return record

    factory.qexp_masks = True
    logging.setLogRecordFactory(factory)


def redact_hydra_outputs() -> None:
    """Mask secrets in the files Hydra wrote for this job (.hydra/config.yaml, overrides.yaml, hydra.yaml) and its
    sweep (multirun.yaml): Hydra writes the command line's values as given."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    paths = []
    if hydra_cfg.output_subdir:
        paths += sorted((Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir).glob("*.yaml"))
    paths.append(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    for path in paths:
        if path.is_file():
            text = path.read_text()
            masked = redact_text(text)
            if masked != text:
                path.write_text(masked)
