"""The run.log artifact: everything qexp's logger says during one run, captured in memory and logged at the end."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Iterator


@contextlib.contextmanager
def captured_log() -> Iterator[io.StringIO]:
    """Capture the "qexp" logger (INFO and up) into a buffer for the duration of a run."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    handler.set_name("qexp-run-log")
    logger = logging.getLogger("qexp")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
