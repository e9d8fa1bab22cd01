"""The algorithms, the calibration and the sensitivity analysis on the run's device (qexp/core/device.py). Without a GPU
the meta device stands in for CUDA: any tensor left on the CPU fails an op that mixes it with a meta one, so each
piece below runs whole there (meta tensors carry shapes, not values, so results are checked on the CPU runs of the
other tests). Results computed on another device are keyed apart from CPU ones; the CPU's keys are unchanged. A GPU
too small for the model is refused in one line from the model's shapes (the GPU is a stand-in here: this host has
none)."""

from __future__ import annotations


import pytest
import torch

from helpers import TINY

META = torch.device("meta")


@pytest.fixture(scope="module")
def tiny_state(compose):
    from qexp.pipeline import prepare

    return prepare(compose(TINY + ["quant=16a4w_block", "quant.block_size=16"], tracked=False), "transform")


def test_layer_by_layer_capture_and_the_weight_searches_run_on_another_device(tiny_state):
    """GPTQ's Hessians and rounding, the output-judged clip search and AWQ's clip on what LayerByLayer captures on
    the meta device; the loaded model's CPU tensors stay where they were."""
    from qexp.transforms.awq import search_clip
    from qexp.transforms.capture import LayerByLayer, input_of
    from qexp.models.static_llama import StaticLlama
    from qexp.transforms.gptq import gptq_quantize, hessian
    from qexp.quant.grid import grid_for, layer_linears
    from qexp.transforms.weight_clip import block_gram, output_mse_scales

    state, cfg = tiny_state, tiny_state.cfg
    static = StaticLlama.private_copy(state.model, cfg.export.max_context_len, cfg.model)
    runner = LayerByLayer(static, state.calibration.samples, META)
    x = runner.run(0, advance=False)
    assert {v.device for v in x.values()} == {META}
    for key in layer_linears(0):
        grid, w, inputs = grid_for(cfg.quant, key), state.model.state_dict[key].to(META), x[input_of(key)]
        for act_order, static_groups in ((True, False), (False, False), (False, True)):
            q, scales = gptq_quantize(w, hessian(inputs), grid, act_order=act_order, static_groups=static_groups)
            assert q.device == META and q.shape == w.shape
        assert output_mse_scales(w, block_gram(inputs, grid.block_size), grid, 4, 0.5).device == META
        assert search_clip(w, grid, inputs[:8], 4, 0.5).device == META
    runner.run(0, inputs=(), advance=True)
    assert runner.run(1)["down_in"].device == META
    assert all(t.device.type == "cpu" for t in state.model.state_dict.values())


def test_rotation_runs_on_another_device_with_the_cpus_hadamard_signs(tiny_state):
    from qexp import upstream
    from qexp.models.static_llama import model_args
    from qexp.upstream.private_quantize import spinquant_rotate

    state, cfg = tiny_state, tiny_state.cfg
    args = model_args(state.model, cfg.export.max_context_len, cfg.export.max_context_len, r3=False)
    module = upstream.LlamaModel(args, ar_len=args.ar_len, output_new_cache_only=True, output_cache=True)
    module.load_state_dict(state.model.state_dict, strict=True)
    module.to(META)
    spinquant_rotate(module, r1=True, r2=True, seed=0, device=META)
    assert {p.device for p in module.parameters()} == {META}


def test_calibration_runs_on_another_device(tiny_state):
    """QnnQuantizer's prepared graph, its observers' statistics included, goes to the meta device and its ops run
    there (SeqMSE runs inside the same placement); afterwards it has its CPU tensors back. The observers' own
    arithmetic branches on values (`min(tensor, tensor)`, `.item()`), which the meta device has not, so here they
    pass their input through; their code creates no CPU tensor (read in ExecuTorch 1.5.1's qualcomm observers), and
    the CUDA test of tests/test_device.py runs them."""
    from qexp.core.device import placed, to_device
    from qexp.quant.calibrate import prepare, weight_observers
    from qexp.core.timing import StageTimer

    state, cfg = tiny_state, tiny_state.cfg
    soc = state.backend.quantizer_soc(cfg)
    prepared = prepare(state.deploy_static, cfg.quant, cfg.observer, soc, True, StageTimer())
    observers = [m for name, m in prepared.named_children() if name.startswith("activation_post_process")]
    for observer in observers:
        observer.forward = lambda x: x  # the stand-in for a forward on values (see above)
    with torch.no_grad(), placed(prepared, META):
        out = prepared(*to_device(state.deploy_static.inputs(state.calibration.samples[0]), META))
        assert out[0].device == META
        assert all(t.device == META for t in list(prepared.parameters()) + list(prepared.buffers()))
        assert weight_observers(prepared)  # the weights' observers are among the placed modules
    assert all(t.device.type == "cpu" for t in list(prepared.parameters()) + list(prepared.buffers()))


def test_the_sensitivity_replay_runs_on_another_device(tiny_state):
    """The analysis' replay (and the recipes' measure, which uses it) on the meta device, on the run's windows."""
    from qexp.core.device import move
    from qexp.sensitivity.replay import LayerReplay
    from qexp.models.static_llama import StaticLlama

    state, cfg = tiny_state, tiny_state.cfg
    selection = state.windows
    static = StaticLlama.private_copy(state.model, selection.seq_len, cfg.model)
    move(static.module, META)
    replay = LayerReplay(static, selection)
    logits = replay.logits(selection.ids[:2])
    assert logits.device == META and logits.shape[0] == 2


class _Unchanged:
    """A transform stand-in that returns its input: only the fingerprint apply_transforms gives it is looked at."""

    name, needs_calibration, cacheable, acts_on, follows_run_device = "unchanged", False, False, "model", True

    def fingerprint(self):
        return {"name": self.name}

    def grid_dependency(self, cfg):
        return {}

    def apply(self, model, context):
        return model


def test_results_computed_on_another_device_are_keyed_apart(tiny_state):
    from qexp.core.provenance import qdq_cache_key
    from qexp.transforms import TransformContext, apply_transforms

    state, cfg = tiny_state, tiny_state.cfg
    keys = {}
    for name, device in (("unset", None), ("cpu", torch.device("cpu")), ("meta", META)):
        context = TransformContext(cfg, state.calibration, state.cache, state.timer, device=device)
        keys[name] = apply_transforms(state.model, [_Unchanged()], context).fingerprint
    assert keys["unset"] == keys["cpu"] != keys["meta"]
    qdq = {d: qdq_cache_key(cfg, state.model, state.deploy_static, state.calibration, "SM8650", (), d)
           for d in (None, torch.device("cpu"), META)}
    assert qdq[None] == qdq[torch.device("cpu")] != qdq[META]
    assert qdq[None] == qdq_cache_key(cfg, state.model, state.deploy_static, state.calibration, "SM8650")


LLAMA_3B = {"n_layers": 28, "dim": 3072, "hidden_dim": 8192, "n_heads": 24, "n_kv_heads": 8, "head_dim": 128,
            "vocab_size": 128256}


def test_a_gpu_too_small_for_the_model_is_one_line_before_it_loads(compose, monkeypatch):
    """The shapes of Llama-3.2-3B (its released config, `shape_llama3_2_3b`) on stand-in GPUs of 16 and 80 GiB."""
    from qexp.core.device import check_fits, gpu_need_gib, static_llama_weights
    from qexp.core.errors import ConfigError
    from qexp.models.shapes import model_dims

    dims = model_dims(compose(["model=shape_llama3_2_3b"], tracked=False).model)  # head_dim: dim / n_heads
    assert dims == {**LLAMA_3B, "head_dim": None, "use_qk_norm": False}
    assert static_llama_weights(dims) == static_llama_weights(LLAMA_3B) == pytest.approx(3.61e9, rel=0.01)  # +lm head
    check_fits(LLAMA_3B, trains=False, total_gib=79.6, name="stand-in 80 GiB GPU")
    with pytest.raises(ConfigError) as refused:
        check_fits(LLAMA_3B, trains=False, total_gib=15.9, name="stand-in 16 GiB GPU")
    assert "stand-in 16 GiB GPU has 15.9 GiB and this model needs about 28.9 GiB" in str(refused.value)
    assert gpu_need_gib(LLAMA_3B, trains=True) > gpu_need_gib(LLAMA_3B, trains=False)
    check_fits({**LLAMA_3B, "vocab_size": None}, trains=False, total_gib=1.0, name="unknown shapes pass")
    # the run's validation asks the GPU torch sees (a stand-in of 16 GiB: this host has none) before any work
    from types import SimpleNamespace

    from qexp.pipeline import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda _: SimpleNamespace(name="stand-in 16 GiB GPU", total_memory=16 * 2**30))
    with pytest.raises(ConfigError, match="stand-in 16 GiB GPU has 16.0 GiB and this model needs about 28.9 GiB"):
        validate(compose(["model=shape_llama3_2_3b", "device=cuda"], tracked=False))
    validate(compose(TINY + ["device=cuda"], tracked=False))  # the tiny model fits


def test_the_parity_script_finds_two_runs_of_one_device_identical(tmp_path):
    """scripts/check_parity.py on the tiny model with the rounding stack, CPU against CPU (the GPU machine runs it
    CPU against CUDA): every stage's perplexity and every integer weight of the QDQ program agree exactly."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    out = subprocess.run([sys.executable, str(REPO / "scripts" / "check_parity.py"), "--out", str(tmp_path),
                          "--devices", "cpu,cpu", *TINY, "quant=16a4w_block", "quant.block_size=16",
                          "algorithm=[rotation,weight_clip,gptq]"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "parity.json").read_text())
    assert list(result["stages"]) == ["fp", "fp_transformed", "qdq"]
    assert all(row["rel_diff"] == 0 and row["within"] for row in result["stages"].values())
    assert result["integer_weights"]["equal_fraction"] == 1.0 and result["integer_weights"]["layers"] > 0
    assert "| qdq |" in (tmp_path / "parity.md").read_text()
