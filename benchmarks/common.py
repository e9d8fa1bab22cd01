"""What the benchmark scripts (benchmarks/) and the research probes (diagnostics/) share: running `python -m qexp` as
a subprocess, timed, against one MLflow store, and logging a script's figures as one run of the MLflow experiment
`benchmarks`; and, for the diagnostics (diagnostics/diag_gptq_heldout.py, diag_seq_mse.py, diag_rotation_awq.py),
the quantized linears of a few decoder layers with their float inputs, and a model's perplexity with some weights
swapped in (weight-only quantization)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch and qexp are imported where used (lazily)
    import torch

    from qexp.quant.grid import WeightGrid

REPO = Path(__file__).resolve().parent.parent


def machine_used_mib() -> float:
    """Memory in use on the whole machine (MiB): MemTotal - MemAvailable from /proc/meminfo.

    Its rise over a run is the process tree's physical memory with each page counted once (a forked worker's
    copy-on-write pages shared with its parent count once, where summed RSS counts them twice), plus whatever else
    the machine did meanwhile (nothing else runs during a benchmark; reclaimable page cache is not counted). Cheap to
    read, unlike PSS (/proc/PID/smaps_rollup), whose sampling slowed the runs it measured."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


def run_qexp(label: str, args: list[str], store: str) -> tuple[float, subprocess.CompletedProcess]:
    """Run `python -m qexp ARGS` logging into `store`; return (wall seconds, the process). Exits on failure."""
    print(f"[bench] {label}: python -m qexp {' '.join(args)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qexp", *args], cwd=REPO,
                          env={**os.environ, "MLFLOW_TRACKING_URI": store}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"[bench] {label} failed (exit {proc.returncode})")
    print(f"[bench] {label}: {wall:.1f} s", flush=True)
    return wall, proc


@contextmanager
def benchmark_run(store: str, run_name: str, benchmark: str, tags: dict):
    """An MLflow run in experiment `benchmarks` of `store`, tagged benchmark=<name> and `tags`."""
    import mlflow

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("benchmarks")
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.set_tags({"benchmark": benchmark, **tags})
        yield run


def write_result(name: str, table, command: str, notes: list[str]) -> Path:
    """A benchmark's table as `results/<name>.md` (with the command, commit, host and date that made it) and `.csv`."""
    import platform
    import socket

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = REPO / "results" / f"{name}.md"
    header = [f"<!-- written by: {command} -->", f"# {name}", "",
              f"`{command}` at commit `{commit}` on {socket.gethostname()} ({cpu}, {os.cpu_count()} cores), "
              f"{time.strftime('%Y-%m-%d')}.", ""]
    body = header + [table.fillna("").to_markdown(index=False), ""] + [f"- {n}" for n in notes]
    out.write_text("\n".join(body) + "\n")
    table.to_csv(out.with_suffix(".csv"), index=False)
    print(f"[bench] wrote {out.relative_to(REPO)}", flush=True)
    return out


@dataclass
class LinearInputs:
    """One quantized linear of a decoder layer with its float inputs: on the calibration samples and on held-out
    evaluation windows (the layer-wise diagnostics' unit)."""
    layer: int
    key: str  # Meta name, e.g. layers.2.feed_forward.w2.weight
    grid: "WeightGrid"
    weight: "torch.Tensor"  # fp32 [out, in]
    calibration: "torch.Tensor"  # [tokens, in], all calibration samples in order
    held_out: "torch.Tensor"  # [tokens, in]

    @property
    def short(self) -> str:
        return self.key.rsplit(".", 2)[1]


def quantized_linears(overrides: list, layers: str, held_out_windows: int):
    """(cfg, state, iterator of LinearInputs) for the quantized linears of `layers` ("0,2,5"), the configured model
    run layer by layer in float (qexp/transforms/capture.py) on the calibration samples and the first
    `held_out_windows` evaluation windows."""
    from hydra import compose, initialize_config_dir

    from qexp.pipeline import prepare
    from qexp.transforms.capture import LayerByLayer, input_of
    from qexp.models.static_llama import StaticLlama
    from qexp.quant.grid import grid_for, layer_linears

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "backend=none"])
    state = prepare(cfg, "calibration")
    model, wanted = state.model, sorted(int(i) for i in layers.split(","))
    static = StaticLlama.private_copy(model, cfg.export.max_context_len, cfg.model)
    calibration = LayerByLayer(static, state.calibration.samples)
    held_out = LayerByLayer(static, [[int(t) for t in w] for w in state.windows.ids[:held_out_windows]])

    def walk():
        for i in range(min(wanted[-1] + 1, model.params["n_layers"])):
            if i not in wanted:
                calibration.run(i, inputs=(), advance=True)
                held_out.run(i, inputs=(), advance=True)
                continue
            xc, xh = calibration.run(i, advance=True), held_out.run(i, advance=True)
            for key in layer_linears(i):
                grid = grid_for(cfg.quant, key)
                if grid is not None and grid.bits < 16:
                    yield LinearInputs(i, key, grid, model.state_dict[key].float(), xc[input_of(key)],
                                       xh[input_of(key)])

    return cfg, state, walk()


def weight_only_evaluation(cfg, model, windows, weights: dict, label: str, before_eval=None):
    """EvalResult of `model` with `weights` (Meta key -> tensor) swapped in, float activations, on `windows` (the FP
    phase's evaluation of the run's static llama; nothing cached). `before_eval(static)`, if given, sees the built
    StaticLlama before the evaluation (e.g. to register forward hooks)."""
    import dataclasses

    import torch

    from qexp.eval.perplexity import evaluate
    from qexp.models.static_llama import StaticLlama, window_logits

    model = dataclasses.replace(model, state_dict={**model.state_dict, **weights})
    static = StaticLlama.for_model_config(model, cfg.export.max_context_len, cfg.model)
    if before_eval is not None:
        before_eval(static)
    with torch.no_grad():
        return evaluate(lambda ids: window_logits(static.module, static, ids), windows, label)


def emulator_config(overrides: list):
    """(cfg, QNN chipset) for the one-op emulator diagnostics: the default experiment's config with `overrides`, the
    QNN SDK libraries in place (diagnostics/diag_htp_norm.py, diag_htp_pointwise.py)."""
    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp import upstream
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.cache import Cache

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=16a4w_wikitext", *overrides])
    ensure_qnn_sdk(Cache(cfg.cache_dir))
    return cfg, getattr(upstream.QcomChipset, cfg.backend.soc.value)


def quantized_on_htp(module, calibration: tuple, inputs: tuple, soc):
    """(HTP's output on `inputs`, the QDQ program) of `module` quantized 16a8w with QnnQuantizer on `calibration`
    (then `inputs`), lowered to HTP for `soc` and run on the x86 HTP emulator."""
    import tempfile

    import torch
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        to_edge_transform_and_lower_to_qnn,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qexp import upstream
    from qexp.upstream.private_runtime import load_program

    quantizer = upstream.QnnQuantizer(soc_model=soc)
    quantizer.set_default_quant_config(upstream.QuantDtype.use_16a8w)
    prepared = prepare_pt2e(torch.export.export(module, inputs, strict=False).module(), quantizer)
    with torch.no_grad():
        prepared(*calibration)
        prepared(*inputs)
    qdq = convert_pt2e(prepared)
    edge = to_edge_transform_and_lower_to_qnn(qdq, inputs, generate_qnn_executorch_compiler_spec(
        soc_model=soc, backend_options=generate_htp_compiler_spec(use_fp16=False)))
    with tempfile.TemporaryDirectory() as tmp:
        pte = Path(tmp) / "op.pte"
        pte.write_bytes(edge.to_executorch().buffer)
        return load_program(str(pte)).forward(inputs)[0], qdq
