"""Quantization-aware training (qexp/transforms/qat.py, qexp/qat/) on the tiny model: it trains against the run's
weight grid and its program rounds the trained weights as training did, its curves and training text are logged
(also from the cache), a killed run resumes from its checkpoint to the same result, and bad settings are refused
before any work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from mlflow.tracking import MlflowClient

from helpers import REPO, TINY, program_weights
from qexp.core.errors import ConfigError, InputError
from qexp.pipeline import prepare, run_experiment, validate
from qexp.quant.grid import grid_for, layer_linears

QAT = TINY + ["algorithm=[qat]", "algorithm.qat.tokens=1024", "algorithm.qat.grad_accum=2",
              "algorithm.qat.validations=4", "algorithm.qat.lr=1e-3"]


@pytest.mark.parametrize("quant", ["16a4w", "16a4w_block"])
def test_the_program_rounds_the_trained_weights_as_training_did(compose, quant):
    state = prepare(compose(QAT + [f"quant={quant}"]), through="qdq")
    model = state.deploy_model
    assert model.transforms == ("qat",) and state.metrics["qat_steps"] == 8
    # training moved the weights (the lm head and embedding stay frozen, as upstream's recipe)
    key = "layers.0.attention.wq.weight"
    assert not torch.equal(model.state_dict[key], state.model.state_dict[key])
    assert torch.equal(model.state_dict["output.weight"], state.model.state_dict["output.weight"])
    # the converted program's integers and scales are the fake quantizer's: round(w / s) on the trained scales
    weights = program_weights(state.qdq.program.module)
    for key in layer_linears(1):
        grid = grid_for(state.cfg.quant, key)
        scales = model.weight_ranges[key] / grid.qmax
        name, expected = state.deploy_static.static_layout(key, grid.quantize(model.state_dict[key], scales))
        ints, scale = weights[name]
        ints = ints.reshape(ints.shape[0], -1).float()
        scale = scale.reshape(ints.shape[0], -1)
        assert torch.allclose(ints * scale.repeat_interleave(ints.shape[1] // scale.shape[1], 1), expected,
                              rtol=0, atol=1e-6), key
    # the trained weights come back on their grid (the student's weights, not the latent ones), so the quantize stage
    # observes the activations of the model that trained
    for key in layer_linears(0) + layer_linears(1):
        grid = grid_for(state.cfg.quant, key)
        weight = model.state_dict[key]
        assert torch.allclose(grid.quantize(weight, model.weight_ranges[key] / grid.qmax), weight, rtol=0,
                              atol=1e-7), key
    assert 0 <= state.metrics["qat_latent_clamped_fraction"] < 1
    # validation starts at the PTQ weights and the kept weights are the best validated ones
    assert state.metrics["qat_val_kd_best"] <= state.metrics["qat_val_kd_start"]


@pytest.mark.parametrize("frozen, trains", [("[tok_embeddings]", ["output.weight"]),
                                             ("[]", ["output.weight", "tok_embeddings.weight"])])
def test_unfrozen_embedding_and_head_train_and_reach_the_program(compose, frozen, trains):
    state = prepare(compose(QAT + [f"algorithm.qat.frozen={frozen}"]), through="qdq")
    for key in ("output.weight", "tok_embeddings.weight"):
        moved = not torch.equal(state.deploy_model.state_dict[key], state.model.state_dict[key])
        assert moved == (key in trains), key


def test_curves_and_training_text_are_logged_while_training_and_also_from_the_cache(compose, store_uri):
    cfg = compose(QAT + ["algorithm.qat.seed=1"])
    first, second = run_experiment(cfg), run_experiment(cfg)
    client = MlflowClient(store_uri)
    for result, hit in ((first, "false"), (second, "true")):
        run = client.get_run(result.run_id)
        assert run.data.tags["transform_cache_hit.qat"] == hit
        history = client.get_metric_history(result.run_id, "qat_train_kd")
        assert [m.step for m in history] == list(range(1, 9))
        validation = client.get_metric_history(result.run_id, "qat_val_kd")
        assert len(validation) == 5  # the start and 4 validations, each once
        if hit == "false":  # logged as the training went (a long one can be watched), not all at its end
            assert min(m.timestamp for m in validation) < max(m.timestamp for m in history)
        training = [d for d in run.inputs.dataset_inputs if any(t.value == "training" for t in d.tags)]
        assert training and training[0].dataset.name == "gensim-enwiki-excerpt:calibration"
    assert first.metrics["ppl_qdq"] == second.metrics["ppl_qdq"]
    assert first.metrics["qat_val_kd_best"] == second.metrics["qat_val_kd_best"]


@pytest.mark.slow
def test_a_killed_training_resumes_from_its_checkpoint_to_the_same_result(tmp_path, store_uri):
    args = ["-m", "qexp", *QAT, "algorithm.qat.tokens=8192", "algorithm.qat.validations=8"]

    def env(cache):
        return {**os.environ, "QEXP_CACHE_DIR": str(cache), "MLFLOW_TRACKING_URI": store_uri}

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env(killed), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    checkpoints = killed / "qat-checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not any(checkpoints.glob("*.pt")):
        time.sleep(0.2)
    assert any(checkpoints.glob("*.pt")), "no checkpoint was written"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run([sys.executable, *args], cwd=REPO, env=env(killed), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "QAT: resuming at step" in resumed.stderr + resumed.stdout
    assert not any(checkpoints.glob("*.pt"))  # removed once the result is in the cache
    whole = subprocess.run([sys.executable, *args], cwd=REPO, env=env(tmp_path / "whole"), capture_output=True,
                           text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    ppl = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "ppl_qdq=" in line]
    ppl_whole = [line for line in (whole.stdout + whole.stderr).splitlines() if "ppl_qdq=" in line]
    assert ppl and ppl[0].split("ppl_qdq=")[1] == ppl_whole[0].split("ppl_qdq=")[1]


@pytest.mark.parametrize("override, message", [
    ("algorithm.qat.lr=0", "algorithm.qat.lr=0"),
    ("quant=fp32", "algorithm qat trains against a quantization grid, and quant=fp32 has none"),
    ("algorithm.qat.learn_scales=true quant=16a4w_block", "learn_scales=true with a per-block"),
    ("algorithm.qat.device=tpu", "algorithm.qat.device='tpu'"),
    ("algorithm.qat.scale_lr=1e-5", "scale_lr=1e-05 without learn_scales=true"),
    ("algorithm.qat.learn_scales=true quant=16a4w algorithm.qat.scale_lr=0", "algorithm.qat.scale_lr=0"),
])
def test_bad_settings_are_refused_before_any_work(compose, override, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(QAT + override.split()))


def test_learned_scales_train_at_their_own_rate(compose):
    """scale_lr is the scales' rate alone: near zero, the scales stay at their start (absmax / qmax) while the weights
    train; at a tenth of the weights' rate they move (at the weights' own 1e-3 the tiny model's validation never
    improves, and the start is kept)."""
    learned = QAT + ["quant=16a4w", "algorithm.qat.learn_scales=true"]
    key = "layers.0.feed_forward.w2.weight"

    def trained(overrides):
        state = prepare(compose(learned + overrides), through="transform")
        start = state.model.state_dict[key].abs().amax(1)  # the initial range of each row: absmax
        model = state.deploy_model
        assert not torch.equal(model.state_dict[key], state.model.state_dict[key])  # the weights trained
        return (model.weight_ranges[key].reshape(-1) / start - 1).abs().max().item()

    assert trained(["algorithm.qat.scale_lr=1e-12"]) < 1e-5
    assert trained(["algorithm.qat.scale_lr=1e-4"]) > 1e-3


def test_a_token_budget_beyond_the_calibration_half_is_refused(compose):
    with pytest.raises(InputError, match=r"algorithm.qat.tokens=100000000 needs \d+ sequences"):
        prepare(compose(QAT + ["algorithm.qat.tokens=100000000"]), through="transform")


def test_a_training_text_sharing_a_run_with_the_windows_is_refused(compose, monkeypatch):
    """The halves share no document, but a text can repeat a passage across documents: the calibration stage checks
    QAT's training and validation sequences against the windows as it checks calibration samples, and refuses one
    that shares a 24-token run, before the FP phase scores anything."""
    import dataclasses

    import numpy as np

    from qexp.data import calibration as calibration_module
    from qexp.transforms import build_transforms

    checked = []
    real = calibration_module.check_rows_disjoint

    def spy(rows, windows, what, fix, *args):
        checked.append((len(rows), what))
        return real(rows, windows, what, fix, *args)

    monkeypatch.setattr(calibration_module, "check_rows_disjoint", spy)
    cfg = compose(QAT)
    state = prepare(cfg, through="calibration")  # the tiny run's training text is disjoint from its windows
    assert state.fp is None  # nothing scored yet: a leaking run is refused before its first phase
    rows, what = build_transforms(cfg.algorithm)[0].fitted_rows(cfg, state.model, state.cache)
    assert checked[1:] == [(len(rows), what)] and "QAT's training sequence {index}" in what  # after the samples' check
    leaked = dataclasses.replace(state.windows, ids=np.concatenate([state.windows.ids, rows[3][None]]))
    with pytest.raises(ConfigError, match="QAT's training sequence 3 .* shares a 24-token run"):
        real(rows, leaked, what, "fix")


def test_the_training_text_decides_the_cache_key_not_the_scored_text(compose):
    """A model trained on wikitext's calibration half and scored on news is the one a wikitext run trained (the
    domain check reuses it); training on news is another model."""
    from qexp.transforms import build_transforms

    def dependency(overrides):
        cfg = compose(QAT + overrides)
        return build_transforms(cfg.algorithm)[0].grid_dependency(cfg)

    assert dependency([]) == dependency(["text=news", "calibration.text=wikitext"])
    assert dependency([]) != dependency(["text=news"])


def test_the_fake_quantizer_has_autograds_straight_through_gradients():
    """The memory-saving autograd function gives the gradients autograd's own graph of the same expression gives:
    bit for bit for the weights, to float error for learned scales (LSQ)."""
    from qexp.qat.fake_quant import _GridRound

    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    s = (w.abs().amax(1, keepdim=True) / 7 * 0.8).expand(64, 96).contiguous()  # clipped scales: some weights outside
    g = torch.randn(64, 96)

    def reference(w, s):
        x = w / s
        return torch.clamp(x + (torch.round(x) - x).detach(), -7, 7) * s

    w1, w2 = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    s1, s2 = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    q1, q2 = reference(w1, s1), _GridRound.apply(w2, s2, 7)
    q1.backward(g)
    q2.backward(g)
    assert torch.equal(q1, q2) and torch.equal(w1.grad, w2.grad)
    assert torch.allclose(s1.grad, s2.grad, atol=1e-6)
    assert (w2.grad == 0).any() and (w2.grad != 0).any()  # the clipped ones get none, the others do


@pytest.mark.parametrize("learn_scales, block", [(False, 0), (True, 0), (False, 16)])
def test_weights_quantized_once_per_step_get_the_per_sequence_gradients(learn_scales, block):
    """A step's micro-batches on weights fake-quantized once (quantized_once) give the latent weights and learned
    scales the gradients that fake-quantizing in every forward gives, to float summation order; a frozen weight
    gets none."""
    from qexp.qat.fake_quant import attach, quantized_once
    from qexp.quant.grid import WeightGrid

    torch.manual_seed(0)
    grid = WeightGrid(bits=4, block_size=block or None)

    def model():
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Conv2d(32, 64, 1, bias=False), torch.nn.Conv2d(64, 8, 1, bias=False))
        net[1].weight.requires_grad_(False)
        scales = {str(i): grid.scales(c.weight.detach().flatten(1)) * 0.8 for i, c in enumerate(net)}
        attach(net, {"0": grid, "1": grid}, scales, learn_scales)
        return net

    batches = [torch.randn(1, 32, 1, 16) for _ in range(3)]
    every, once = model(), model()
    for x in batches:
        every(x).square().sum().backward()
    with quantized_once(once, ["0", "1"], grad=True):
        for x in batches:
            once(x).square().sum().backward()
    for (name, a), (_, b) in zip(every.named_parameters(), once.named_parameters()):
        if a.requires_grad:
            assert b.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name
        else:
            assert b.grad is None, name
    assert once[0].parametrizations["weight"][0].held is None  # released: later forwards see the latent weights
