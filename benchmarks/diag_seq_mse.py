"""Diagnostic: why ExecuTorch's SeqMSE loses to round-to-nearest on SmolLM2 (results/algorithms_paired.md).

ExecuTorch's pass (executorch/backends/qualcomm/_passes/seq_mse.py, run by qexp/quant/seq_mse.py as upstream's llama
flow runs it) picks, per linear, ONE factor f for all of the layer's weight scales (candidates 1/n .. 1, then a fine
sweep around the best), minimising the mean square of the layer's output error on ONE calibration sample (256
tokens), the float inputs. This script redoes that search for the linears of a few decoder layers, on the QNN grid
(qexp/transforms/grid.py), and asks three questions of each layer:

- share0: how much of the sample's output energy ||W x_t||^2 is carried by its first token (SmolLM2's attention-sink
  token carries massive activations), and f / f_no0: the factor chosen with and without that token;
- rel. error on held-out windows (the evaluation's first windows) of RTN (f = 1), of the factor upstream chooses and
  of a per-row search on the same objective over all calibration samples (weight_clip's `objective: outputs`):
  if upstream's factor is better than RTN on its sample but worse on held-out tokens, the loss is its one sample and
  one factor per layer, not a bug in the grid;
- gain: the least-squares scale of each one's output against the float output on held-out tokens: one factor < 1
  for all of a layer's scales clips every row's largest weights towards zero, a shrinkage that the mean square
  error trades for less rounding noise, but which does not average out across layers as rounding noise does.

    .venv/bin/python benchmarks/diag_seq_mse.py                              # SmolLM2, 16a4w per channel
    .venv/bin/python benchmarks/diag_seq_mse.py --layers 0,1,2 quant=16a4w_block quant.block_size=64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def relative_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    return float(((w - q) @ x.T).pow(2).sum() / (w @ x.T).pow(2).sum())


def output_gain(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    """<Q x, W x> / ||W x||^2: the least-squares scale of the quantized layer's output against the float one
    (1: no systematic shrinkage; round to nearest's errors are nearly unbiased, clipped scales shrink)."""
    reference = x @ w.T
    return float((x @ q.T * reference).sum() / reference.pow(2).sum())


def upstream_factor(w: torch.Tensor, scales: torch.Tensor, grid, x: torch.Tensor, candidates: int) -> float:
    """SeqMseModule._find_best_candidate's search, on the QNN grid: f = 1 first, a coarse sweep over
    linspace(1/n, 1, n), then n fine steps within one coarse step of the best; loss = mean square output error.
    Redone here because the module needs a prepared graph's conv node and weight observer; its factors equal the ones
    the product's seq_mse run bakes into the QDQ program (checked against that run's quant/encodings.csv)."""
    reference = x @ w.T

    def loss(step: float) -> float:
        return float(torch.nn.functional.mse_loss(x @ grid.quantize(w, scales * step).T, reference))

    best, best_loss = 1.0, loss(1.0)
    coarse = torch.linspace(1 / candidates, 1, steps=candidates).tolist()
    for step in coarse:
        value = loss(step)
        if value < best_loss:
            best, best_loss = step, value
    resolution = 1.0 / candidates
    for step in torch.linspace(max(best - resolution, 0.001), min(best + resolution, 1.0), steps=candidates).tolist():
        value = loss(step)
        if value < best_loss:
            best, best_loss = step, value
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="0,1,2,5,15,29")
    parser.add_argument("--held-out-windows", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=30)  # conf/algorithm/seq_mse.yaml
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from benchmarks.common import quantized_linears
    from qexp.transforms.weight_clip import block_gram, output_mse_scales

    overrides = args.overrides or ["quant=16a4w", "calibration.sampling=spread"]
    cfg, state, linears = quantized_linears(overrides, args.layers, args.held_out_windows)
    first = len(state.calibration.samples[0])  # SeqMSE's sample: the first one, as qexp/quant/seq_mse.py runs it
    print(f"{cfg.quant.scheme}, SeqMSE sample: {first} tokens; held out: {args.held_out_windows} windows")
    print("layer linear  share0     f   f_no0 | sample: rtn upstream | held out: rtn upstream per_row | up/rtn | "
          "gain: rtn upstream per_row")
    ratios, gains = [], []
    for linear in linears:
        w, grid, xh = linear.weight, linear.grid, linear.held_out
        x0 = linear.calibration[:first]
        scales = grid.scales(w)
        energy = (x0 @ w.T).pow(2).sum(1)
        share0 = float(energy[0] / energy.sum())
        f = upstream_factor(w, scales, grid, x0, args.candidates)
        f_no0 = upstream_factor(w, scales, grid, x0[1:], args.candidates)
        per_row = output_mse_scales(w, block_gram(linear.calibration, grid.block_size or w.shape[1]), grid)
        rtn, up, row = grid.quantize(w, scales), grid.quantize(w, scales * f), grid.quantize(w, per_row)
        sample = [relative_error(w, q, x0) for q in (rtn, up)]
        held = [relative_error(w, q, xh) for q in (rtn, up, row)]
        gain = [output_gain(w, q, xh) for q in (rtn, up, row)]
        ratios.append(held[1] / held[0])
        gains.append(gain)
        print(f"{linear.layer:5d} {linear.short:6s} {share0:6.3f} {f:6.3f} {f_no0:6.3f} | "
              f"{sample[0]:.2e} {sample[1]:.2e} | {held[0]:.2e} {held[1]:.2e} {held[2]:.2e} | "
              f"{held[1] / held[0]:.2f} | {gain[0]:.4f} {gain[1]:.4f} {gain[2]:.4f}", flush=True)
    worse = sum(r > 1 for r in ratios)
    print(f"upstream's factor raises the held-out output error over RTN on {worse} of {len(ratios)} linears "
          f"(median ratio {torch.tensor(ratios).median().item():.2f}, max {max(ratios):.2f})")
    median = torch.tensor(gains).median(0).values.tolist()
    print("median output gain on held-out tokens: rtn %.4f, upstream %.4f, per-row %.4f" % tuple(median))


if __name__ == "__main__":
    main()
