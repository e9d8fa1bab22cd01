"""The parallel HTP lowering's process handling (qexp/backends/htp/parallel.py), without QNN: a worker that fails or
dies ends the compile with one line naming the graph and the reason, and leaves no process behind. (The lowering
itself, against upstream's one-process lowering, is tested on the emulator in test_htp.py.)"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from qexp.backends.htp.parallel import lower_in_workers


class _Program:
    """What the parent does with its own lowered program before collecting the workers' (drop_unused_weights):
    an ExportedProgram's signature, state_dict and graph module, empty."""

    def __init__(self):
        import torch
        from types import SimpleNamespace

        self.graph_signature = SimpleNamespace(inputs_to_parameters={}, inputs_to_buffers={})
        self.state_dict, self.graph_module = {}, torch.nn.Module()


class _Lowered:
    def exported_program(self, name):
        return _Program()


def _children():
    """This process's live children (the test session may hold others: servers, watchdogs of earlier tests)."""
    out = set()
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_failing_worker_is_one_line_naming_its_graph():
    def lower_one(subset):
        if "prefill_forward" in subset:
            raise ValueError("could not create op: q::ConvLayer_s1.opt")
        return _Lowered()

    before = _children()
    with pytest.raises(RuntimeError) as error:
        lower_in_workers({"kv_forward": dict, "prefill_forward": dict}, lower_one)
    assert str(error.value) == ("the compile worker for prefill_forward failed: ValueError: could not create op: "
                                "q::ConvLayer_s1.opt")
    assert _children() <= before


def test_a_killed_worker_says_it_was_killed():
    def lower_one(subset):
        if "prefill_forward" in subset:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        return _Lowered()

    before = _children()
    with pytest.raises(RuntimeError, match="prefill_forward died with SIGKILL .*out of memory.*compile_workers=1"):
        lower_in_workers({"kv_forward": dict, "prefill_forward": dict}, lower_one)
    assert _children() <= before


def test_the_parent_failing_first_kills_the_workers():
    def lower_one(subset):
        if "kv_forward" in subset:
            raise KeyboardInterrupt  # the user, during the parent's own graph
        signal.pause()  # the worker would still be busy

    before = _children()
    with pytest.raises(KeyboardInterrupt):
        lower_in_workers({"kv_forward": dict, "prefill_forward": dict}, lower_one)
    assert _children() <= before


def test_a_worker_dies_with_its_killed_parent(tmp_path):
    """The parent killed outright (SIGKILL, the OOM killer) takes its compile worker with it: no orphan lowering on."""
    import subprocess
    import sys
    import time

    worker_pid = tmp_path / "worker.pid"
    script = f"""
import os, signal, time
from pathlib import Path
from qexp.backends.htp.parallel import lower_in_workers

def lower_one(subset):
    if "prefill_forward" in subset:
        Path({str(worker_pid)!r}).write_text(str(os.getpid()))
        signal.pause()
    while not Path({str(worker_pid)!r}).exists():
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)

lower_in_workers({{"kv_forward": dict, "prefill_forward": dict}}, lower_one)
"""
    parent = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert parent.returncode == -signal.SIGKILL
    pid = int(worker_pid.read_text())
    deadline = time.time() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_lowering_bars_tick_and_stop_each_graph_when_it_is_done(capsys):
    """One live line per graph: elapsed seconds while it lowers, "done in N s" after; a worker's graph stops its clock
    when the worker writes its result (polled), not when the parent gets round to collecting it."""
    import time

    from qexp.backends.htp.progress import labels_for, lowering_bars

    labels = labels_for(["kv_forward", "prefill_forward"], {"prefill_forward": 4242})
    assert labels == {"kv_forward": "this process", "prefill_forward": "worker process 4242"}
    finished = time.time()
    with lowering_bars(labels, {"prefill_forward": lambda: finished}, interval=0.05) as done:
        time.sleep(0.6)
        here = done("kv_forward")
        worker = done("prefill_forward")
    assert here >= 0.6 and worker < 0.3, (here, worker)
    err = capsys.readouterr().err
    assert "lower kv_forward (this process): done in 1 s" in err
    assert "lower prefill_forward (worker process 4242): done in 0 s" in err


def test_each_graph_is_built_in_the_process_that_lowers_it(monkeypatch):
    """A graph given as a builder is built after the fork, by the worker that lowers it (the parent never holds it),
    and what the program's assembly needs of it (lower.GRAPH_INFO) comes back with the lowered program. The
    serializer is replaced here: there is no real program to carry without QNN."""
    from qexp.backends.htp import parallel

    monkeypatch.setattr(parallel, "to_payload", lambda program: {"artifact": None, "meta": {}})
    monkeypatch.setattr(parallel, "from_payload", lambda payload: "read back")
    built_by = {}

    def builder(name):
        def build():
            built_by[name] = os.getpid()  # seen by this process only: a worker's write stays in the worker
            return {"meta": {"pid": os.getpid()}, "encodings": name, "quantize_s": 1.0, "module": object()}
        return build

    before = _children()
    programs, infos = lower_in_workers({"kv_forward": builder("kv_forward"),
                                        "prefill_forward": builder("prefill_forward")}, lambda subset: _Lowered())
    assert list(programs) == list(infos) == ["kv_forward", "prefill_forward"]
    assert programs["prefill_forward"] == "read back"
    assert built_by == {"kv_forward": os.getpid()}  # the parent built its own graph only
    assert infos["kv_forward"]["meta"]["pid"] == os.getpid()
    assert infos["prefill_forward"]["meta"]["pid"] != os.getpid()  # built in the worker
    assert infos["prefill_forward"] == {"meta": infos["prefill_forward"]["meta"], "encodings": "prefill_forward",
                                        "quantize_s": 1.0}  # the graph itself stays in the worker
    assert _children() <= before
