"""Diagnostic: does GPTQ's layer-wise objective carry over from the calibration tokens to held-out tokens?

For a few decoder layers of the configured model, every linear is quantized onto its QNN grid by round-to-nearest,
by GPTQ in column order (dynamic block scales) and by GPTQ with act_order, each from the Hessian of the calibration
tokens. Prints the relative output error ||(W - Q) X|| ^ 2 / ||W X|| ^ 2 of each on the calibration tokens and on
the first evaluation windows (held out), the layers' inputs taken from the float model. This is how qexp found why
GPTQ in column order lost to RTN on SmolLM2 (docs/research/2026-11-25-algorithms-smollm2.md): the down projections
overfit the calibration Hessian. The clip columns are round-to-nearest and GPTQ (act_order) onto weight_clip's
scales (the weights' own rounding error minimised): this is how qexp found why weight_clip alone loses on SmolLM2
(docs/research/2026-11-26-weight-clip-and-calibration.md): the early down projections' held-out error grows up to
12x. The out_clip columns are the same onto weight_clip's `objective: outputs` scales (the calibration tokens'
output error minimised).

    .venv/bin/python diagnostics/diag_gptq_heldout.py                       # SmolLM2, LPBQ block 32
    .venv/bin/python diagnostics/diag_gptq_heldout.py --layers 0,5 quant=16a4w calibration.limit=32
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="0,1,2,5,15,29")
    parser.add_argument("--held-out-windows", type=int, default=8)
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from benchmarks.common import quantized_linears
    from qexp.transforms.gptq import gptq_quantize, hessian
    from qexp.transforms.weight_clip import block_gram, mse_scales, output_mse_scales

    overrides = args.overrides or ["quant=16a4w_block", "quant.block_size=32", "calibration.sampling=spread"]
    _, _, linears = quantized_linears(overrides, args.layers, args.held_out_windows)
    print("layer linear | calibration: rtn gptq act_order clip clip_gptq out_clip out_clip_gptq | held out: the same")
    for linear in linears:
        w, grid, xc, xh = linear.weight, linear.grid, linear.calibration, linear.held_out
        h = hessian(xc)
        clip = mse_scales(w, grid)
        output_clip = output_mse_scales(w, block_gram(xc, grid.block_size or w.shape[1]), grid)
        quantized = {"rtn": grid.quantize(w), "gptq": gptq_quantize(w, h, grid)[0],
                     "act_order": gptq_quantize(w, h, grid, act_order=True)[0],
                     "clip": grid.quantize(w, clip), "clip_gptq": gptq_quantize(w, h, grid, act_order=True,
                                                                              scales=clip)[0],
                     "out_clip": grid.quantize(w, output_clip),
                     "out_clip_gptq": gptq_quantize(w, h, grid, act_order=True, scales=output_clip)[0]}
        cal = " ".join(f"{relative_error(w, q, xc):.2e}" for q in quantized.values())
        held = " ".join(f"{relative_error(w, q, xh):.2e}" for q in quantized.values())
        print(f"{linear.layer:5d} {linear.short:6s} | {cal} | {held}", flush=True)

if __name__ == "__main__":
    main()
