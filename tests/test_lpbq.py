"""LPBQ block scales (qexp/quant/lpbq.py): the QDQ program's per-block weight scales are the ones HTP's lowering
encodes (ExecuTorch's `make_qnn_per_block_config`: a float unit per channel, max scale / 16, times a 4-bit integer
per block in [1, 16], the integer weights kept), so the CPU phase computes what the device runs."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY, program_weights
from qexp.core.config import BlockScaleRounding
from qexp.pipeline import prepare
from qexp.quant.lpbq import SCALE_STEPS, quantize_block_scales
from qexp.quant.grid import WeightGrid


def lowering_encoding(scales: torch.Tensor):
    """ExecuTorch 1.5.1's arithmetic, backends/qualcomm/builders/node_visitor.py, make_qnn_per_block_config:
    max_scales = candidates.amax(-1) / 2**4; q_scales = clamp(round(candidates / max_scales), 1, 2**4)."""
    candidates = scales.reshape(scales.shape[0], -1)
    unit = candidates.amax(dim=-1) / SCALE_STEPS
    steps = torch.clamp(torch.round(candidates / unit.unsqueeze(-1)), 1, SCALE_STEPS)
    return unit, steps


def random_block_scales(seed=0, out=64, blocks=12):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(out, blocks, generator=g).pow(3) * 0.05 + 1e-4  # wide spread: many small blocks


def test_nearest_is_what_the_lowering_encodes_and_the_lowering_keeps_it():
    scales = random_block_scales()
    unit, steps = lowering_encoding(scales)
    ours = quantize_block_scales(scales, BlockScaleRounding.nearest)
    assert torch.allclose(ours, steps * unit.unsqueeze(-1), rtol=1e-6, atol=0)
    # lowering our scales again changes nothing: HTP runs exactly the scales the QDQ program used
    unit2, steps2 = lowering_encoding(ours)
    assert torch.allclose(unit2, unit, rtol=1e-6) and torch.equal(steps2, steps)
    assert not torch.allclose(ours, scales, rtol=1e-3)  # the float scales were not representable


def test_up_never_shrinks_a_block_and_is_representable():
    scales = random_block_scales(1)
    up = quantize_block_scales(scales, BlockScaleRounding.up)
    assert (up >= scales * (1 - 1e-6)).all()
    unit, steps = lowering_encoding(up)
    assert torch.allclose(steps * unit.unsqueeze(-1), up, rtol=1e-6, atol=0)
    assert torch.allclose(quantize_block_scales(up, BlockScaleRounding.up), up, rtol=1e-6, atol=0)


def test_float_keeps_the_scales_and_the_grid_searches_on_lpbq_scales():
    scales = random_block_scales(2)
    assert torch.equal(quantize_block_scales(scales, BlockScaleRounding.float), scales)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    w[:, :16] *= 10  # one wide block per row, three narrow ones
    grid = WeightGrid(4, 16)
    unit, steps = lowering_encoding(grid.scales(w))
    assert torch.allclose(grid.scales(w), steps * unit.unsqueeze(-1), rtol=1e-6)
    float_grid = WeightGrid(4, 16, BlockScaleRounding.float)
    assert torch.allclose(float_grid.scales(w), w.reshape(8, 4, 16).abs().amax(-1) / 7)
    # per channel: one scale per row is exact on HTP (LPBQ with one block per row: step 16), never changed
    assert torch.equal(WeightGrid(4).scales(w), WeightGrid(4, None, BlockScaleRounding.float).scales(w))


def block_scales_of_program(state) -> dict:
    out = {}
    for name, (ints, scale) in program_weights(state.qdq.program.module).items():
        if scale.dim() >= 2 and scale.reshape(scale.shape[0], -1).shape[1] > 1:
            out[name] = (ints, scale.reshape(scale.shape[0], -1))
    return out


@pytest.mark.parametrize("rounding", ["nearest", "up"])
def test_the_qdq_program_and_the_deploy_graphs_use_representable_block_scales(compose, rounding):
    from qexp.backends.htp.graph import quantized_graph

    state = prepare(compose(TINY + ["quant=16a4w_block", "quant.block_size=16",
                                    f"quant.block_scale_rounding={rounding}"]), through="qdq")
    blocks = block_scales_of_program(state)
    assert blocks, "no per-block weights in a 16a4w_block program"
    for name, (ints, scale) in blocks.items():
        unit, steps = lowering_encoding(scale)
        assert torch.allclose(steps * unit.unsqueeze(-1), scale, rtol=1e-5, atol=0), name
        assert int(ints.abs().max()) <= 7
    # the kv graph (another AR length) built from the cached statistics gets the same scales and integers
    stats = torch.load(state.qdq.program.stats_path, weights_only=True)
    cfg = state.cfg
    converted, _ = quantized_graph(state.deploy_model, 64, 1, state.deploy_static.r3, cfg.quant, cfg.observer, stats,
                                   cfg.model.recompose_hadamard, "SM8650")
    deployed = program_weights(converted)
    for name, (ints, scale) in blocks.items():
        assert torch.equal(deployed[name][0], ints) and torch.allclose(deployed[name][1].reshape(scale.shape), scale)


def test_float_block_scales_are_what_the_lowering_would_change(compose):
    state = prepare(compose(TINY + ["quant=16a4w_block", "quant.block_size=16", "quant.block_scale_rounding=float"]),
                    through="qdq")
    off = 0
    for name, (_, scale) in block_scales_of_program(state).items():
        unit, steps = lowering_encoding(scale)
        off += int((~torch.isclose(steps * unit.unsqueeze(-1), scale, rtol=1e-4)).sum())
    assert off > 0  # the mismatch this module removes exists on the tiny model


@pytest.mark.parametrize("rounding", [BlockScaleRounding.nearest, BlockScaleRounding.up])
def test_awq_clip_searches_lpbq_steps_and_the_observer_keeps_the_chosen_step(rounding):
    """AWQ's clip search under LPBQ: the clipped weights' block scales, as the observer then stores them, are the
    steps the search scored, and the block output error is no worse than not clipping on the same LPBQ grid."""
    from qexp.transforms.awq import search_clip

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 128, generator=g) * torch.rand(48, 128, generator=g).pow(4)  # heavy-tailed blocks
    x = torch.randn(256, 128, generator=g)
    grid = WeightGrid(4, 32, rounding)
    clipped = search_clip(w, grid, x, n_grid=20, max_shrink=0.5)
    assert not torch.equal(clipped, w)  # something was clipped

    def block_error(v):  # per (row, block) partial output error of v quantized on the LPBQ grid vs the float w
        q = grid.quantize(v).reshape(48, 4, 32)
        return torch.einsum("obk,tbk->obt", q - w.reshape(48, 4, 32), x.reshape(256, 4, 32)).pow(2).mean(-1)

    assert block_error(clipped).sum() < block_error(w).sum()
    # the row unit is unchanged (the row's largest block is never clipped) ...
    raw = lambda v: (v.reshape(48, 4, 32).abs().amax(-1) / grid.qmax)  # noqa: E731
    assert torch.allclose(raw(clipped).amax(-1), raw(w).amax(-1))
    # ... and every clipped block's max sits on a step, so the observer's rounding picks exactly that step
    unit = raw(w).amax(-1, keepdim=True) / SCALE_STEPS
    shrunk = raw(clipped) < raw(w) - 1e-9
    ratio = (raw(clipped) / unit)[shrunk]
    assert shrunk.any() and torch.allclose(ratio, ratio.round(), atol=1e-4)


def test_calibration_algorithms_search_against_lpbq_block_scales(compose):
    """A calibration-time algorithm (SeqMSE) runs after the first sample's forward: by then each per-block weight
    observer already holds the LPBQ scales HTP will run, so a scale search judges those, not the float ones."""
    from qexp.quant.calibrate import quantize, weight_observers
    from qexp.quant.lpbq import is_block_observer
    from qexp.cache import Cache

    seen = []

    class Probe:
        name = "probe"

        def calibrate(self, prepared, static, calibration, device):
            for observer in weight_observers(prepared).values():
                if is_block_observer(observer):
                    scale, _ = observer.calculate_qparams()
                    seen.append(scale.reshape(scale.shape[0], -1).clone())

    state = prepare(compose(TINY + ["quant=16a4w_block", "quant.block_size=16"]), through="calibration")
    cfg = state.cfg
    quantize(state.fp_static, cfg.quant, cfg.observer, state.calibration, Cache(cfg.cache_dir), "probe-lpbq",
             "SM8650", algorithms=[Probe()])
    assert len(seen) == 14  # q, k, v, o, w1, w2, w3 x 2 layers
    for scales in seen:
        unit, steps = lowering_encoding(scales)
        assert torch.allclose(scales, steps * unit.unsqueeze(-1), rtol=1e-5, atol=0)
