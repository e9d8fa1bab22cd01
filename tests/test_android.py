"""backend.target=android through the whole run, with adb replaced by a stand-in.

RecordingAdbStandIn is a test double for the one thing that cannot exist on this machine: a phone over adb. It
records every adb command and answers like a device running qnn_llama_runner would (files it writes are served
on pull). Everything else (compile, tokenizer, metrics, MLflow) is real.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

import qexp.backends.htp.android as android_module
from test_htp import HTP_RUN
from qexp.core.errors import InputError
from qexp.pipeline import run_experiment


class RecordingAdbStandIn:
    """Stand-in for adb + a phone (see module docstring)."""

    commands: list = []
    attached = True
    vocab = 512

    def __init__(self, serial):
        self.serial = serial

    def available(self):
        return True

    def state(self):
        return "device" if self.attached else "unknown"

    def push(self, local, remote):
        self.commands.append(("push", Path(local).name, remote))
        if local.endswith("input_tokens.raw"):
            self.last_tokens = np.fromfile(local, dtype=np.uint64)

    def shell(self, command):
        self.commands.append(("shell", command))
        if "--prompt" in command:
            stats = {"prompt_tokens": 15, "generated_tokens": 8, "inference_start_ms": 1000,
                     "prompt_eval_end_ms": 1030, "first_token_ms": 1032, "inference_end_ms": 1100}
            return "generated text\nPyTorchObserver " + json.dumps(stats) + "\n"
        return ""

    def pull(self, remote, local):
        self.commands.append(("pull", remote))
        if remote.endswith("all_logits.raw"):  # uniform logits (zero point of a 16-bit output)
            np.full((len(self.last_tokens), self.vocab), 32768, dtype=np.uint16).tofile(local)
        elif remote.endswith("inference_speed.txt"):
            Path(local).write_text("123.4")


@pytest.fixture
def device_files(tmp_path):
    runner = tmp_path / "qnn_llama_runner"
    runner.write_bytes(b"\x7fELF stand-in")
    libs = tmp_path / "qnn_libs"
    libs.mkdir()
    for name in ("libQnnHtp.so", "libQnnSystem.so", "libQnnHtpV75Stub.so"):
        (libs / name).write_bytes(b"")
    return [f"backend.runner={runner}", f"backend.qnn_lib_dir={libs}", "backend.target=android",
            "backend.serial=R5CT000STANDIN"]


# lookahead with test_lookahead.py's window and verification candidates: its program, compiled once for both files
LOOKAHEAD = ["backend.window=3", "backend.gcap=3"]


@pytest.mark.parametrize("mode,eval_mode", [("hybrid", 1), ("lookahead", 2)])
def test_android_run_with_stand_in(compose, store_uri, device_files, monkeypatch, mode, eval_mode):
    RecordingAdbStandIn.commands = []
    monkeypatch.setattr(android_module, "Adb", RecordingAdbStandIn)
    extra = LOOKAHEAD if mode == "lookahead" else []
    result = run_experiment(compose(HTP_RUN + device_files + [f"backend.model_mode={mode}", *extra]))
    run = MlflowClient(store_uri).get_run(result.run_id)
    assert run.data.tags["target"] == "android" and run.data.tags["deployed_eval_path"] == "device_kv"
    pushed = {c[1] for c in RecordingAdbStandIn.commands if c[0] == "push"}
    assert {"model.pte", "tokenizer.json", "qnn_llama_runner", "libQnnHtp.so", "input_tokens.raw"} <= pushed
    shells = [c[1] for c in RecordingAdbStandIn.commands if c[0] == "shell"]
    logits_cmd = next(s for s in shells if "--dump_logits_path" in s)
    assert "--eval_mode 0" in logits_cmd and "--tokenized_prompt input_tokens.raw" in logits_cmd
    assert "--model_path model.pte" in logits_cmd and "--decoder_model_version llama2" in logits_cmd
    speed_cmd = next(s for s in shells if "--prompt" in s)
    assert f"--eval_mode {eval_mode}" in speed_cmd
    assert ("--ngram 3 --window 3 --gcap 3" in speed_cmd) == (mode == "lookahead")
    m = run.data.metrics
    assert m["ppl_deployed"] == pytest.approx(512, rel=1e-6)  # the stand-in's uniform logits
    assert m["decode_tok_s"] == pytest.approx(123.4) and m["ttft_ms"] == 32 and m["prefill_tok_s"] == 500


def test_no_adb(compose, device_files, monkeypatch):
    monkeypatch.setattr(android_module.shutil, "which", lambda name: None)
    with pytest.raises(InputError, match="needs adb"):
        run_experiment(compose(HTP_RUN + device_files))


def test_no_device(compose, device_files, monkeypatch):
    monkeypatch.setattr(RecordingAdbStandIn, "attached", False)
    monkeypatch.setattr(android_module, "Adb", RecordingAdbStandIn)
    with pytest.raises(InputError, match="no Android device"):
        run_experiment(compose(HTP_RUN + device_files))


def test_no_runner_binary(compose, device_files, monkeypatch, tmp_path):
    monkeypatch.setattr(android_module, "Adb", RecordingAdbStandIn)
    with pytest.raises(InputError, match="qnn_llama_runner binary not found"):
        run_experiment(compose(HTP_RUN + device_files + [f"backend.runner={tmp_path}/missing"]))
