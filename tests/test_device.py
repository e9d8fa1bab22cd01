"""The run's device (`device: auto | cpu | cuda`, qexp/core/device.py). On this CPU host: bad devices are one line
before any work with a FAILED run; auto and cpu give the same run (figures, config hash, cache keys) as before the
setting; the FP and QDQ programs run whole on another device (the meta device stands in for CUDA: a tensor left on
the CPU fails the forward) and get their very CPU tensors back; a report refuses CPU and CUDA perplexities in one
table."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from helpers import TINY
from test_cli import _qexp

NO_CUDA = "needs a CUDA device (torch sees none here)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
@pytest.mark.parametrize("device,message", [
    ("cuda", "device=cuda, and torch sees no CUDA device"),
    ("mps", "device='mps' is not a device qexp runs on"),
])
def test_a_device_qexp_cannot_use_is_one_line_and_a_failed_run(device, message, cache_dir, store_uri):
    from mlflow.tracking import MlflowClient

    out = _qexp(TINY + [f"device={device}", f"tracking.run_name=bad-device-{device}"], cache_dir, store_uri)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("qexp: error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in out.stderr
    assert "stage load" not in out.stderr  # refused before the model loads
    client = MlflowClient(store_uri)
    runs = client.search_runs([client.get_experiment_by_name("cli").experiment_id],
                              f"attributes.run_name = 'bad-device-{device}'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_cpu_and_auto_are_the_run_from_before_the_setting(compose):
    """Without a GPU, auto is the CPU; the CPU leaves the config hash and the FP cache key as they were."""
    from qexp.pipeline import RunState, validate
    from qexp.core.provenance import config_hash

    from omegaconf import open_dict

    before = compose(TINY)
    with open_dict(before):
        del before["device"]  # a config composed before the setting existed
    for device in ("auto", "cpu"):
        cfg = compose(TINY + [f"device={device}"])
        if torch.cuda.is_available() and device == "auto":
            continue
        assert config_hash(cfg) == config_hash(before)
        assert RunState(cfg, validate(cfg)).device == torch.device("cpu")
    assert compose(TINY + ["algorithm=[qat]", "device=cpu"]).algorithm.qat.device == "cpu"  # QAT follows it
    if not torch.cuda.is_available():  # the default experiment's hash from before the setting: its runs still match
        assert config_hash(compose(["+experiment=16a4w_wikitext"])) == "01e40352968d3b2a"


def test_the_fp_and_qdq_programs_run_whole_on_another_device(compose):
    """`placed` moves every parameter, buffer and constant of the static llama and of the folded QDQ program: their
    forward on the meta device touches no CPU tensor. Afterwards the CPU logits are bit-identical."""
    from qexp.core.device import placed
    from qexp.models.static_llama import window_logits
    from qexp.pipeline import prepare
    from qexp.quant.fold import with_weights_dequantized

    state = prepare(compose(TINY + ["quant=16a4w"], tracked=False), "qdq")
    meta = torch.device("meta")
    ids = state.windows.ids[0]
    programs = {"fp": (state.fp_static.module, state.fp_static),
                "qdq": (with_weights_dequantized(state.qdq.program.module, None), state.deploy_static)}
    for name, (module, static) in programs.items():
        before = window_logits(module, static, ids)
        tensors = [id(t) for t in list(module.parameters()) + list(module.buffers())]
        with placed(module, meta):
            out = module(*(t.to(meta) for t in static.inputs(ids)))
            assert (out[0] if isinstance(out, (tuple, list)) else out).device == meta, name
            assert all(t.device == meta for t in list(module.parameters()) + list(module.buffers())), name
        assert [id(t) for t in list(module.parameters()) + list(module.buffers())] == tensors, name
        assert torch.equal(window_logits(module, static, ids), before), name


def test_a_table_refuses_cpu_and_cuda_perplexities_together():
    from qexp.report import ReportError, with_current_names
    from qexp.report.table import _check_comparable

    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "tags.text_sha256": ["t"] * 3,
                         "params.eval.window_len": ["256"] * 3, "params.eval.n_windows": ["32"] * 3,
                         "tags.device": [None, "cpu", "cuda"]})
    runs = with_current_names(runs)
    assert list(runs["tags.device"]) == ["cpu", "cpu", "cuda"]  # runs from before the setting ran on the CPU
    assert _check_comparable(runs.iloc[:2], allow_mixed=False) is None
    with pytest.raises(ReportError, match="device=cpu .*device=cuda"):
        _check_comparable(runs, allow_mixed=False)
    assert "device=cuda" in _check_comparable(runs, allow_mixed=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_runs_score_within_the_cpu_runs_interval(compose):
    from qexp.pipeline import run_experiment

    metrics = {d: run_experiment(compose(TINY + ["quant=16a4w", f"device={d}"])).metrics for d in ("cpu", "cuda")}
    for phase in ("fp", "qdq"):
        cpu, cuda = metrics["cpu"][f"ppl_{phase}"], metrics["cuda"][f"ppl_{phase}"]
        assert cuda == pytest.approx(cpu, rel=1e-3), (phase, cpu, cuda)


def test_the_task_scorers_run_whole_on_another_device(compose):
    """The FP and QDQ task scorers on the meta device: inputs and the head's row selection go to the module's device,
    which the scorer moves there at its first call (the loaded model's CPU tensors are untouched)."""
    from qexp.pipeline import prepare
    from qexp.quant.fold import with_weights_dequantized
    from qexp.tasks.head_rows import head_rows
    from qexp.tasks.packing import PackedScorer

    state = prepare(compose(TINY + ["quant=16a4w"], tracked=False), "qdq")
    meta = torch.device("meta")
    embedding = state.model.state_dict["tok_embeddings.weight"].clone()
    folded = with_weights_dequantized(state.qdq.program.module, None)
    for module, static in ((state.fp_static.module, state.fp_static), (folded, state.deploy_static)):
        scorer = PackedScorer(module, static, "meta", head_rows(module, static.ar_len), meta)
        rows = [0, 5, 9]
        logits = scorer.forward(static.inputs(state.windows.ids[0]), rows)
        assert logits.device == meta and logits.shape == (len(rows), static.vocab_size)
    assert torch.equal(state.model.state_dict["tok_embeddings.weight"], embedding)
