"""The run.log artifact (everything qexp's logger says during one run) and native.log (what native libraries
print while a backend runs), captured and logged with the run."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from typing import Iterator


# The name of the handler that collects run.log (parallel.py adds its compile workers' lines through it).
RUN_LOG_HANDLER = "qexp-run-log"

# Loggers whose INFO lines are the user's: qexp's own and Hydra's (its launcher lists each job of a multirun).
_TERMINAL_LOGGERS = ("qexp", "hydra")


class LibraryChatterFilter(logging.Filter):
    """On the terminal's handlers: libraries' records below ERROR (ExecuTorch's QNN preprocess logs one INFO line
    per graph node, hundreds per compile; deprecation notices at WARNING) are dropped there; they are kept in the
    run's run.log artifact, which takes every logger. `verbose=true` removes the filter."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.split(".")[0] in _TERMINAL_LOGGERS
        return own or record.levelno >= logging.ERROR


@contextlib.contextmanager
def captured_log(verbose: bool = False) -> Iterator[io.StringIO]:
    """Capture every logger (INFO and up: qexp's lines and the libraries' chatter) into a buffer for the duration of
    a run (the run.log artifact), and keep the libraries' chatter off the terminal unless `verbose`."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    handler.set_name(RUN_LOG_HANDLER)
    root, logger = logging.getLogger(), logging.getLogger("qexp")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    previous_root_level = root.level
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)  # libraries' INFO lines reach run.log even outside Hydra's logging setup
    terminal = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
                and getattr(h.stream, "name", None) in ("<stdout>", "<stderr>")]
    chatter = LibraryChatterFilter()
    for h in terminal if not verbose else []:
        h.addFilter(chatter)
    root.addHandler(handler)
    # Python warnings (libraries' FutureWarnings and deprecation notices, e.g. torch's pytree warning on every
    # unpickled graph) become records of the `py.warnings` logger: in run.log, off the terminal unless `verbose`.
    # qexp's own warnings are log records of its logger and stay on the terminal.
    logging.captureWarnings(True)
    try:
        yield buffer
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(previous_root_level)
        for h in terminal:
            h.removeFilter(chatter)


@contextlib.contextmanager
def native_output_captured(enabled: bool = True) -> Iterator[io.StringIO]:
    """Send what native libraries print (QNN's compile progress, ExecuTorch's runtime INFO lines: tens of thousands
    of lines for one SmolLM2 compile) to a buffer instead of the terminal, at the file-descriptor level, so C++
    output is caught too. The buffer becomes the run's `native.log` artifact: nothing is lost. Python's own output
    (qexp's log lines, progress bars) keeps going to the terminal: its handlers and sys.stdout/sys.stderr are pointed
    at copies of the terminal's descriptors meanwhile. With `enabled=False` (config `verbose=true`) everything goes
    to the terminal live and the buffer stays empty."""
    buffer = io.StringIO()
    if not enabled:
        yield buffer
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = {fd: os.fdopen(os.dup(saved[fd]), "w", buffering=1, encoding="utf-8", errors="replace")
                for fd in (1, 2)}
    python_streams = {id(sys.stdout): terminal[1], id(sys.stderr): terminal[2]}
    handlers = [h for logger in (logging.getLogger(), logging.getLogger("qexp")) for h in logger.handlers
                if isinstance(h, logging.StreamHandler) and id(h.stream) in python_streams]
    previous = {"stdout": sys.stdout, "stderr": sys.stderr,
                "handlers": [(h, h.setStream(python_streams[id(h.stream)])) for h in handlers]}
    sys.stdout, sys.stderr = terminal[1], terminal[2]
    captured: list = []
    try:
        with fds_captured(saved) as captured:
            try:
                yield buffer
            finally:
                sys.stdout, sys.stderr = previous["stdout"], previous["stderr"]
                for handler, stream in previous["handlers"]:
                    handler.setStream(stream)
                for fd in saved:
                    terminal[fd].flush()
                    terminal[fd].close()
    finally:
        buffer.write(b"".join(captured).decode("utf-8", errors="replace"))


@contextlib.contextmanager
def fds_captured(saved: dict = None) -> Iterator[list]:
    """What is written to file descriptors 1 and 2 meanwhile (C++ output included), as bytes in the yielded list
    once the block ends; `saved` (fd -> a dup of it, made by the caller) is restored and closed at the end."""
    saved = saved if saved is not None else {fd: os.dup(fd) for fd in (1, 2)}
    out: list = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield out
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            out.append(sink.read())
