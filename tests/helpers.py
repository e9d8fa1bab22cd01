"""Constants shared by the tests (fixtures are in conftest.py, which tests never import)."""

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"

# Tiny model, short windows: a whole experiment takes seconds.
TINY = [
    "model=tiny",
    "eval.seq_len=64",
    "eval.limit=3",
    "calibration.limit=3",
]


def free_port() -> int:
    """A loopback port nobody listens on (for a test server, or an unreachable one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    """Poll an MLflow server's /health until it answers; kill `proc` and fail if it never does."""
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(url.rstrip("/") + "/health", timeout=1).ok:
                return
        except requests.RequestException:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"{what} did not start")


def stop_server(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM a server started with start_new_session=True and all its workers; SIGKILL what outlives `grace`.

    A loaded host can take longer than any fixed grace to shut gunicorn/uvicorn down cleanly; a test's teardown is
    not the place to fail for that, but it must not leave processes behind either."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what outlived the grace, and workers that outlived their parent
    proc.wait(timeout=30)


def program_weights(module) -> dict:
    """{static parameter name: (integer weights, scales)} of a converted QDQ program's conv weights, named by the
    consuming conv's module path (a reloaded program calls its constants _frozen_paramN)."""
    import torch

    from qexp.quant.encodings import _DEQUANT_OPS

    out = {}
    for node in module.graph.nodes:
        kind = _DEQUANT_OPS.get(str(node.target))
        source = node.args[0] if node.args else None
        if node.op != "call_function" or kind is None or getattr(source, "op", None) != "get_attr":
            continue
        user = next(iter(node.users))
        if len(user.args) > 1 and user.args[1] is not node:  # a conv's bias (Qwen2's q/k/v), not its weight
            continue
        stack = user.meta.get("nn_module_stack")
        path = list(stack.values())[-1][0].replace(".forward.__self__", "")
        scale = node.args[2] if kind == "per_block" else node.args[1]
        scale = getattr(module, scale.target) if hasattr(scale, "op") else torch.tensor([float(scale)])
        out[path + ".weight"] = (getattr(module, source.target), scale)
    return out
