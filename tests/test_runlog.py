"""The run's log capture: every logger's lines reach the run.log buffer; on the terminal, libraries' chatter below
ERROR is dropped (ExecuTorch's QNN preprocess logs a line per graph node) and qexp's / Hydra's lines stay;
verbose=true keeps everything on the terminal."""

from __future__ import annotations

import io
import logging

import pytest

from qexp.tracking.runlog import captured_log


@pytest.fixture
def terminal():
    """A handler like Hydra's console handler (a StreamHandler on sys.stdout), writing into a buffer."""
    import sys

    buffer = io.StringIO()
    buffer.name = "<stdout>"  # what the capture recognises as the terminal
    handler = logging.StreamHandler(buffer)
    root = logging.getLogger()
    root.addHandler(handler)
    yield buffer
    root.removeHandler(handler)
    assert sys.stdout is not None


@pytest.mark.parametrize("verbose", [False, True])
def test_library_chatter_goes_to_run_log_not_terminal(terminal, verbose):
    import warnings

    with captured_log(verbose=verbose) as run_log, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning)  # torch, on unpickling
        logging.getLogger("executorch.backends.qualcomm.qnn_preprocess").info("Visiting: aten_conv")
        logging.getLogger("executorch.exir.pass_manager").warning("PassManager is deprecated")
        logging.getLogger("executorch.backends").error("a real library error")
        logging.getLogger("qexp").info("stage compile: start")
        logging.getLogger("hydra.launcher").info("#0 : quant=16a4w")
    logged, shown = run_log.getvalue(), terminal.getvalue()
    for line in ("Visiting: aten_conv", "PassManager is deprecated", "a real library error", "stage compile",
                 "#0 : quant=16a4w", "LeafSpec"):
        assert line in logged
    for line in ("a real library error", "stage compile", "#0 : quant=16a4w"):
        assert line in shown
    assert ("Visiting: aten_conv" in shown) == verbose and ("PassManager is deprecated" in shown) == verbose
    assert ("LeafSpec" in shown) == verbose
    # the filter is gone after the run
    logging.getLogger("executorch.x").warning("after the run")
    assert "after the run" in terminal.getvalue()
