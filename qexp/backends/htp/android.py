"""backend.target=android: run the compiled .pte on a phone with a user-built `qnn_llama_runner`, over adb.

Mirrors upstream's device flow (examples/qualcomm/oss_scripts/llama/evaluator/device_evaluator.py): push the .pte,
the runtime tokenizer, the QNN libraries and the runner into a workspace, run the runner with a tokenized prompt
(raw uint64) and `--dump_logits_path`, pull the dumped uint16 logits and `inference_speed.txt`. NOT verified on a
phone here (no device can exist on this machine); the unit tests drive it through a recording stand-in for adb.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from qexp.core.errors import InputError

log = logging.getLogger("qexp")

WORKSPACE = "/data/local/tmp/qexp"
EVAL_MODE = {"kv": 0, "hybrid": 1, "lookahead": 2}  # qnn_llama_runner --eval_mode (upstream decoder_constants)


class Adb:
    """`adb -s SERIAL ...` as subprocesses."""

    def __init__(self, serial: Optional[str]):
        self.serial = serial

    def _base(self) -> List[str]:
        return ["adb"] + (["-s", self.serial] if self.serial else [])

    def run(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(self._base() + list(args), capture_output=True, text=True, timeout=3600)
        if check and proc.returncode != 0:
            raise InputError(f"adb {' '.join(args[:2])} failed: {proc.stderr.strip()[:200]}", "check the device")
        return proc.stdout

    def available(self) -> bool:
        return shutil.which("adb") is not None

    def state(self) -> str:
        return self.run("get-state", check=False).strip()

    def push(self, local: str, remote: str) -> None:
        self.run("push", local, remote)

    def pull(self, remote: str, local: str) -> None:
        self.run("pull", remote, local)

    def shell(self, command: str) -> str:
        return self.run("shell", command)


class AndroidTarget:
    def __init__(self, backend, runtime_tokenizer: str, decoder_model_version: str, adb: Optional[Adb] = None):
        self.backend = backend
        self.adb = adb or Adb(backend.serial)
        self.runtime_tokenizer = runtime_tokenizer
        self.decoder_model_version = decoder_model_version
        self.pte_name: Optional[str] = None

    def check(self) -> None:
        """One clear line for each thing a device run needs and lacks."""
        if not self.adb.available():
            raise InputError("backend.target=android needs adb, which is not on PATH",
                             "install Android platform-tools, or use backend.target=x86_emulator")
        if self.adb.state() != "device":
            raise InputError(f"no Android device {'with serial ' + self.backend.serial if self.backend.serial else ''} "
                             "is attached".replace("  ", " "), "connect one (adb devices) and set backend.serial")
        runner = self.backend.runner
        if not runner or not Path(runner).expanduser().is_file():
            raise InputError(f"backend.runner={runner}: qnn_llama_runner binary not found",
                             "build it (ExecuTorch Qualcomm backend, Android) and pass its path")
        libs = self.backend.qnn_lib_dir
        if not libs or not Path(libs).expanduser().is_dir() or not list(Path(libs).expanduser().glob("*.so")):
            raise InputError(f"backend.qnn_lib_dir={libs}: no QNN libraries for the device there",
                             "pass a folder with the aarch64/hexagon QNN libraries (libQnnHtp.so, stubs, skels)")

    def deploy(self, pte: Path) -> None:
        self.adb.shell(f"mkdir -p {WORKSPACE}/outputs")
        files = [str(pte), self.runtime_tokenizer, str(Path(self.backend.runner).expanduser())]
        files += sorted(str(p) for p in Path(self.backend.qnn_lib_dir).expanduser().glob("*.so"))
        for path in files:
            self.adb.push(path, f"{WORKSPACE}/")
        self.pte_name = pte.name

    def _runner_command(self, mode: str, seq_len: int, extra: Sequence[str]) -> str:
        runner = Path(self.backend.runner).name
        args = [
            f"./{runner}", f"--decoder_model_version {self.decoder_model_version}",
            f"--tokenizer_path {Path(self.runtime_tokenizer).name}", f"--model_path {self.pte_name}",
            f"--output_path {WORKSPACE}/outputs/outputs.txt",
            f"--performance_output_path {WORKSPACE}/outputs/inference_speed.txt",
            "--shared_buffer", f"--eval_mode {EVAL_MODE[mode]}", "--temperature 0", f"--seq_len {seq_len}", *extra,
        ]
        return f"cd {WORKSPACE} && export LD_LIBRARY_PATH=. && export ADSP_LIBRARY_PATH=. && " + " ".join(args)

    def logits(self, ids: Sequence[int], vocab: int, scale: float, zero_point: int) -> torch.Tensor:
        """Logits of every position of `ids` (kv eval mode, as upstream's perplexity path)."""
        with tempfile.TemporaryDirectory() as tmp:
            tokens = Path(tmp) / "input_tokens.raw"
            np.asarray(ids, dtype=np.uint64).tofile(tokens)
            self.adb.push(str(tokens), f"{WORKSPACE}/")
            self.adb.shell(self._runner_command("kv", len(ids) + 1, [
                f"--dump_logits_path {WORKSPACE}/outputs/all_logits.raw", "--tokenized_prompt input_tokens.raw"]))
            local = Path(tmp) / "all_logits.raw"
            self.adb.pull(f"{WORKSPACE}/outputs/all_logits.raw", str(local))
            raw = np.fromfile(local, dtype=np.uint16).reshape(-1, vocab)[: len(ids)]
        return (torch.from_numpy(raw.astype(np.float32)) - zero_point) * scale

    def speed(self, prompt_text: str, mode: str, seq_len: int) -> dict:
        """The runner's own figures: decode tok/s from inference_speed.txt, and its stats line when it prints one."""
        extra = [f"--prompt {shlex.quote(prompt_text)}"]
        if mode == "lookahead":  # the runner's lookahead decoder takes the shape the graph was compiled for
            extra += [f"--ngram {self.backend.ngram}", f"--window {self.backend.window}", f"--gcap {self.backend.gcap}"]
        out = self.adb.shell(self._runner_command(mode, seq_len, extra))
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "inference_speed.txt"
            self.adb.pull(f"{WORKSPACE}/outputs/inference_speed.txt", str(local))
            metrics = {"decode_tok_s": float(local.read_text().strip())}
        stats = re.search(r"PyTorchObserver (\{.*\})", out)
        if stats:  # ExecuTorch LLM runner stats (whole milliseconds)
            s = json.loads(stats.group(1))
            metrics["ttft_ms"] = float(s["first_token_ms"] - s["inference_start_ms"])
            prefill_ms = max(s["prompt_eval_end_ms"] - s["inference_start_ms"], 1)
            metrics["prefill_tok_s"] = 1000.0 * s["prompt_tokens"] / prefill_ms
        return metrics


# ---------------------------------------------------------------- the HTP phase on a phone
def runtime_tokenizer(model, cache) -> str:
    """The tokenizer file qnn_llama_runner reads: tokenizer.json (HF), tokenizer.bin (llama2c), tokenizer.model."""
    from qexp.cache import file_sha256

    tokenizer = model.tokenizer
    if tokenizer.kind == "hf":
        return str(Path(tokenizer.path) / "tokenizer.json")
    if tokenizer.kind == "tiktoken":
        return tokenizer.path

    def build(tmp: Path) -> dict:
        import sys

        subprocess.run([sys.executable, "-m", "pytorch_tokenizers.tools.llama2c.convert", "-t", tokenizer.path,
                        "-o", str(tmp / "tokenizer.bin")], check=True, capture_output=True)
        return {}

    entry, _ = cache.get_or_build("tokenizer_bin", file_sha256(tokenizer.path)[:24], build)
    return str(entry / "tokenizer.bin")


def android_target(cfg, model, cache, adb=None) -> AndroidTarget:
    from executorch.examples.qualcomm.oss_scripts.llama.decoder_constants import DECODER_MODEL_VERSION

    target = AndroidTarget(cfg.backend, "", DECODER_MODEL_VERSION.get(cfg.model.arch, "llama3"), adb=adb)
    target.check()  # before any compile: a missing adb / device / runner is one line, not minutes later
    target.runtime_tokenizer = runtime_tokenizer(model, cache)
    return target


def run_on_device(inputs, program, device: AndroidTarget, result):
    """The emulator path's metrics, measured by the phone's qnn_llama_runner (target=android)."""
    from qexp.eval.perplexity import evaluate

    cfg, windows, timer = inputs.cfg, inputs.windows, inputs.timer
    with timer.stage("deploy_android"):
        device.deploy(program.pte_path)
    first = next(iter(program.meta["encodings"].values()))
    scale, zero_point = first["logits"]
    vocab = inputs.model.params["vocab_size"]
    subset = windows.within_budget(cfg.backend.eval_tokens, inputs.model.tokenizer)
    with timer.stage("eval_deployed"):
        result.deployed = evaluate(lambda ids: device.logits(ids, vocab, scale, zero_point), subset, "HTP")
    result.tags.update({"deployed_eval_path": "device_kv",
                        "deployed_eval_path_reason": "qnn_llama_runner --dump_logits_path"})
    prompt_text = inputs.model.tokenizer.decode(windows.ids[0][windows.first_target : cfg.backend.bench.prompt_len])
    with timer.stage("bench_deployed"):
        result.metrics.update(device.speed(prompt_text, cfg.backend.model_mode.value, cfg.backend.max_seq_len))
    return result
