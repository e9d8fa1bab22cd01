"""Diagnostic: why ExecuTorch's SeqMSE loses to round-to-nearest on SmolLM2 (results/algorithms_paired.md).

ExecuTorch's pass (executorch/backends/qualcomm/_passes/seq_mse.py, run by qexp/transforms/seq_mse.py as upstream's
llama flow runs it) picks, per linear, ONE factor f for all of the layer's weight scales (candidates 1/n .. 1, then a
fine sweep around the best), minimising the mean square of the layer's output error on ONE calibration sample (256
tokens), the float inputs. This script redoes that search for the linears of a few decoder layers, on the QNN grid
(qexp/quant/grid.py), and asks three questions of each layer:

- share0: how much of the sample's output energy ||W x_t||^2 is carried by its first token (SmolLM2's attention-sink
  token carries massive activations), and f / f_no0: the factor chosen with and without that token;
- rel. error on held-out windows (the evaluation's first windows) of RTN (f = 1), of the factor upstream chooses and
  of a per-row search on the same objective over all calibration samples (weight_clip's `objective: outputs`):
  if upstream's factor is better than RTN on its sample but worse on held-out tokens, the loss is its one sample and
  one factor per layer, not a bug in the grid;
- gain: the least-squares scale of each one's output against the float output on held-out tokens: one factor < 1
  for all of a layer's scales clips every row's largest weights towards zero, a shrinkage that the mean square
  error trades for less rounding noise, but which does not average out across layers as rounding noise does.

With `--whole-model` it tests the shrinkage causally, on the whole model's perplexity with float activations (weight-
only quantization, so nothing but the weights differs between the variants): every quantized linear of all layers by
RTN, by upstream's factor, by upstream's factor with its shrinkage undone (each linear's output rescaled by 1 / its
least-squares gain on the calibration sample: the same integers at a larger per-layer scale, a legal QNN encoding),
RTN shrunk by upstream's gain (the integers of RTN, upstream's shrinkage), the float model shrunk by that gain, and
upstream's finer step without its clipping (not a legal 4-bit encoding: the clipping's share); then upstream's factor
on one kind of linear, one range of layers or one of the last layers at a time (RTN elsewhere), and with each gate/up
projection's largest-weight row put back at RTN (an outlier neuron?): where the loss is. Each Δ vs RTN carries its
paired 95% interval over the windows.

    .venv/bin/python diagnostics/diag_seq_mse.py                              # SmolLM2, 16a4w per channel
    .venv/bin/python diagnostics/diag_seq_mse.py --layers 0,1,2 quant=16a4w_block quant.block_size=64
    .venv/bin/python diagnostics/diag_seq_mse.py --whole-model                # the causal test, all 30 layers
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


def whole_model(args, overrides: list) -> None:
    from benchmarks.common import quantized_linears, weight_only_evaluation
    from qexp.eval.uncertainty import ppl_ratio_interval

    layers = ",".join(str(i) for i in range(64))  # every layer the model has
    cfg, state, linears = quantized_linears(overrides, layers, args.held_out_windows)
    first = len(state.calibration.samples[0])
    rtn, variants = {}, {name: {} for name in ("upstream", "upstream_gain_undone", "upstream_unclipped",
                                               "rtn_shrunk", "fp_shrunk")}
    gains = []
    for linear in linears:
        w, grid, x0 = linear.weight, linear.grid, linear.calibration[:first]
        scales = grid.scales(w)
        f = upstream_factor(w, scales, grid, x0, args.candidates)
        up = grid.quantize(w, scales * f)
        gain = output_gain(w, up, x0)  # on SeqMSE's own sample: what a corrected search could use
        gains.append((f, gain, output_gain(w, up, linear.held_out)))
        fine = grid.expand(scales * f, w.shape[1])
        dtype = state.model.state_dict[linear.key].dtype
        rtn[linear.key] = grid.quantize(w, scales).to(dtype)
        for name, value in (("upstream", up), ("upstream_gain_undone", up / gain),
                            # upstream's finer step without its clipping (more than 4 bits: not a legal encoding)
                            ("upstream_unclipped", torch.round(w / fine) * fine),
                            ("rtn_shrunk", rtn[linear.key] * gain), ("fp_shrunk", w * gain)):
            variants[name][linear.key] = value.to(dtype)
        print(f"layer {linear.layer:2d} {linear.short:6s} f {f:.3f} gain (sample) {gain:.4f}", flush=True)
    g = torch.tensor(gains)
    print(f"{len(gains)} linears; median factor {g[:, 0].median():.3f}, median gain on the sample "
          f"{g[:, 1].median():.4f}, on held-out windows {g[:, 2].median():.4f}")
    # where the loss is: upstream's factor on one kind of linear (or one range of layers), RTN on the rest
    upstream = variants["upstream"]
    for short in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        variants[f"upstream on {short} only"] = {**rtn, **{k: v for k, v in upstream.items() if f".{short}." in k}}
    n_layers, step = state.model.params["n_layers"], 6
    for lo in range(0, n_layers, step):
        span = range(lo, min(lo + step, n_layers))
        variants[f"upstream on layers {span[0]}-{span[-1]} only"] = {
            **rtn, **{k: v for k, v in upstream.items() if int(k.split(".")[1]) in span}}
    last = range(n_layers - step, n_layers)
    for i in last:
        variants[f"upstream on layer {i} only"] = {**rtn, **{k: v for k, v in upstream.items()
                                                           if int(k.split(".")[1]) == i}}
    in_last_ffn = [k for k in upstream if int(k.split(".")[1]) in last and (".w1." in k or ".w3." in k)]
    variants[f"upstream on layers {last[0]}-{last[-1]} w1,w3 only"] = {**rtn, **{k: upstream[k] for k in in_last_ffn}}
    variants[f"upstream except layers {last[0]}-{last[-1]} w1,w3"] = {**upstream, **{k: rtn[k] for k in in_last_ffn}}
    # the outlier neurons: in every gate/up projection, the one row holding the layer's largest weight back at RTN
    top_rows = {}
    for k in upstream:
        if ".w1." in k or ".w3." in k:
            row = int(state.model.state_dict[k].abs().amax(1).argmax())
            top_rows[k] = upstream[k].clone()
            top_rows[k][row] = rtn[k][row]
    variants["upstream, gate/up's largest-weight row at RTN"] = {**upstream, **top_rows}
    print(f"weight-only perplexity ({cfg.quant.scheme}, float activations), {state.windows.n_windows} windows x "
          f"{cfg.eval.seq_len} tokens; Δ paired, vs RTN (the float model shrunk: vs FP):")
    print(f"  {'fp':50s} {state.fp.metrics()['ppl']:8.3f}")
    rtn_result = None
    for name, weights in {"rtn": rtn, **variants}.items():
        shrunk_float = name == "fp_shrunk"  # its other weights float: compared with FP, not RTN
        result = weight_only_evaluation(cfg, state.model, state.windows, weights if shrunk_float else
                                        {**rtn, **weights}, name)
        rtn_result = rtn_result or result
        reference, label = (state.fp, "fp") if shrunk_float else (rtn_result, "rtn")
        ppl, ci = result.metrics()["ppl"], ppl_ratio_interval(result.logprobs, reference.logprobs)
        delta = ppl / reference.metrics()["ppl"] - 1
        vs = "" if result is reference else (f"{delta:+7.1%} [{ci['ci_low']:+.1%}, {ci['ci_high']:+.1%}] vs {label}"
                                             f"{' ~' if ci['ci_low'] < 0 < ci['ci_high'] else ''}")
        print(f"  {name:50s} {ppl:8.3f}  {vs}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="0,1,2,5,15,29")
    parser.add_argument("--held-out-windows", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=30)  # conf/algorithm/seq_mse.yaml
    parser.add_argument("--whole-model", action="store_true", help="the causal test (see above)")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from benchmarks.common import quantized_linears
    from qexp.transforms.weight_clip import block_gram, output_mse_scales

    overrides = args.overrides or ["quant=16a4w", "calibration.sampling=spread"]
    if args.whole_model:
        return whole_model(args, overrides)
    cfg, state, linears = quantized_linears(overrides, args.layers, args.held_out_windows)
    first = len(state.calibration.samples[0])  # SeqMSE's sample: the first one, as qexp/transforms/seq_mse.py runs it
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
