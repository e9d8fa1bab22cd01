"""Diagnostic: HTP's 16-bit MatMul, Softmax, Sigmoid and GELU against the QDQ program and eval.htp_exact.

One op alone, quantized 16a8w with QnnQuantizer, lowered to HTP and run on the x86 HTP emulator: the sigmoid and the
GELU on a ramp through all 65,536 codes of an input range (so the input encoding is that range exactly), the softmax
on rows of Gaussian attention scores with a causal mask, the matmul on Gaussian operands (the second one int16
symmetric, as QNN quantizes it; given directly, and converted from a uint16 tensor as in the attention). For each
input it prints, in the output's 16-bit codes, how far HTP is from: the fake-quant QDQ program, eval.htp_exact's
program (qexp/quant/htp_arithmetic.py: softmax with a 15-bit exp and floored, sigmoid floored to 15 bits, GELU with
HTP's measured phi; for the matmul, the candidate model that keeps the accumulator to 2**16 units) and a reference
candidate (softmax floored
without the 15-bit exp, sigmoid floored to 16 bits; erf-GELU): share of codes identical, mean (HTP minus model: a
bias) and rms.

    .venv/bin/python diagnostics/diag_htp_pointwise.py                       # every op, several inputs
    .venv/bin/python diagnostics/diag_htp_pointwise.py --write-gelu-table    # re-measure qexp/quant/htp_gelu_phi.csv

--write-gelu-table measures phi(x) = 4096 * HTP(x) / x, averaged over a 1/128 grid of x, from the ranges [-1.5, 1.5]
(|x| < 1.4, where the finer output step resolves phi) and [-8, 8] (the rest), and writes the table eval.htp_exact
interpolates. The ranges scored afterwards are other ranges than those (except where marked "table's own").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlflow
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run, emulator_config, quantized_on_htp  # noqa: E402

TABLE_SOURCES = [(-1.5, 1.5, 0.0, 1.4), (-8.0, 8.0, 1.4, 8.0)]  # (input range, |x| taken from it)
TABLE_STEP = 1 / 128
RANGES = {"sigmoid": [(-16.0, 16.0), (-40.0, 25.0), (-6.0, 6.0)],
          "gelu": [(-5.0, 5.0), (-12.0, 12.0), (-30.0, 20.0), (-8.0, 8.0)]}
SOFTMAX_ROWS = [(64, 1.0), (128, 2.0), (256, 3.0)]  # (keys, score std)


class Pointwise(torch.nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, x):
        if self.op == "sigmoid":
            return torch.sigmoid(x)
        if self.op == "softmax":
            return torch.softmax(x, dim=-1)
        return torch.nn.functional.gelu(x, approximate="tanh")  # what Gemma's MLP computes


def on_htp(op: str, x: torch.Tensor, soc, with_model: bool = True) -> dict:
    """The op alone quantized 16a8w on `x` (its calibration and its input), on the emulator, with the QDQ program
    and (with_model) htp_exact's; outputs as codes of the output encoding."""
    from qexp.quant.fold import with_weights_dequantized

    htp, qdq = quantized_on_htp(Pointwise(op).eval(), (x,), (x,), soc)
    (in_scale, in_zp), (out_scale, out_zp) = encodings(qdq)
    exact = with_weights_dequantized(qdq, "lpbq") if with_model else None
    with torch.no_grad():
        fake, modelled = qdq(x), exact(x) if with_model else torch.full_like(x, float("nan"))
    x_q = torch.clamp(torch.round(x.double() / in_scale) + in_zp, 0, 65535)
    counts = exact.htp_counts if with_model else None
    return {"x": ((x_q - in_zp) * in_scale), "htp": codes(htp, qdq), "fake_quant": codes(fake, qdq),
            "htp_exact": codes(modelled, qdq), "y_htp": htp.double().flatten(), "in": (in_scale, in_zp),
            "out": (out_scale, out_zp),
            "modelled": counts.softmaxes + counts.sigmoids + counts.gelus if with_model else 0}


def encodings(qdq) -> tuple:
    """((scale, zero point) of the program's first quantize: its input), (the same of its last: its output))."""
    quantizes = [n for n in qdq.graph.nodes if n.op == "call_function" and "quantize_per_tensor" in str(n.target)
                 and "dequantize" not in str(n.target)]
    return tuple(quantizes[0].args[1:3]), tuple(quantizes[-1].args[1:3])


def codes(y: torch.Tensor, qdq) -> torch.Tensor:
    """`y` (dequantized) as codes of the program's output encoding, flat, float64."""
    scale, zero_point = encodings(qdq)[1]
    return torch.round(y.double().flatten() / scale) + zero_point


def all_codes_on_htp(op: str, lo: float, hi: float, soc, with_model: bool = True) -> dict:
    """The op over every uint16 input code of [lo, hi] (a ramp: the input encoding is that range exactly)."""
    scale = (hi - lo) / 65535
    zero_point = round(-lo / scale)
    x = ((torch.arange(65536, dtype=torch.float64) - zero_point) * scale).float().reshape(1, 1, 256, 256)
    probe = on_htp(op, x, soc, with_model)
    probe["x"] = probe["x"].flatten()
    return probe


class Matmul(torch.nn.Module):
    """a @ b, b either straight from the input (QNN quantizes it to int16 symmetric for the matmul) or, as in the
    static llama's attention, through a uint16 tensor first (b * 0.5 * 2.0: exact on its codes), which HTP converts."""

    def __init__(self, convert: bool):
        super().__init__()
        self.convert = convert

    def forward(self, a, b):
        return torch.matmul(a, b * 0.5 * 2.0 if self.convert else b)


def matmul_on_htp(convert: bool, soc) -> dict:
    """One 32x64 by 64x128 matmul of Gaussian activations (a offset so that its zero point is not 2**15) on the
    emulator, with the QDQ program and the candidate matmul model's; outputs as codes of the output encoding."""
    from qexp.quant.fold import with_weights_dequantized

    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 1, 32, 64, generator=generator) + 0.5, torch.randn(1, 1, 64, 128, generator=generator))
    htp, qdq = quantized_on_htp(Matmul(convert).eval(), inputs, inputs, soc)
    exact = with_weights_dequantized(qdq, "lpbq", htp_exact_models=("matmul_accumulator_floor",))
    with torch.no_grad():
        fake, modelled = qdq(*inputs), exact(*inputs)
    return {"htp": codes(htp, qdq), "fake_quant": codes(fake, qdq), "matmul_model": codes(modelled, qdq),
            "modelled": exact.htp_counts.matmuls}


def softmax_rows_on_htp(keys: int, std: float, soc) -> dict:
    """Softmax over rows of Gaussian scores (8 heads, `keys` queries and keys, std `std`) with a causal mask of -255
    (what the static llama adds), as attention computes it."""
    generator = torch.Generator().manual_seed(keys)
    scores = torch.randn(1, 8, keys, keys, generator=generator) * std
    return on_htp("softmax", scores + torch.triu(torch.full((keys, keys), -255.0), diagonal=1), soc)


def reference_candidate(op: str, probe: dict) -> tuple[str, torch.Tensor]:
    x, (scale, zp) = probe["x"], probe["out"]
    if op == "sigmoid":
        return "floor_16bit", torch.clamp(torch.floor(torch.sigmoid(x) / scale) + zp, 0, 65535)
    if op == "softmax":  # the program's softmax with a floored requantization, without the 15-bit exp
        return "floor_only", torch.clamp(torch.floor(torch.softmax(x, -1).flatten() / scale) + zp, 0, 65535)
    return "erf_gelu", torch.clamp(torch.round(torch.nn.functional.gelu(x) / scale) + zp, 0, 65535)


def agreement(htp: torch.Tensor, model: torch.Tensor) -> dict:
    difference = htp - model
    return {"identical": (difference == 0).double().mean().item(), "mean": difference.mean().item(),
            "rms": difference.pow(2).mean().sqrt().item()}


def report_row(key: str, model: str, htp: torch.Tensor, modelled: torch.Tensor) -> dict:
    """Print one model's agreement with HTP; return it as metrics named after `key`."""
    row = agreement(htp, modelled)
    print(f"  {model:12s} identical {100 * row['identical']:5.1f}%  mean {row['mean']:+6.2f}  rms {row['rms']:6.2f}")
    return {f"{key}_{k}": v for k, v in row.items()}


def write_gelu_table(soc, path: Path) -> None:
    sums = {}
    for lo, hi, inner, outer in TABLE_SOURCES:
        probe = all_codes_on_htp("gelu", lo, hi, soc, with_model=False)
        x, y = probe["x"], probe["y_htp"]
        keep = (x.abs() >= max(inner, 1 / 16)) & (x.abs() < outer)  # phi = y / x is unresolved right at 0
        bins = torch.round(x[keep] / TABLE_STEP).long()
        phi = 4096 * y[keep] / x[keep]
        for b, value in zip(bins.tolist(), phi.tolist()):
            total, count = sums.get(b, (0.0, 0))
            sums[b] = (total + value, count + 1)
    grid = torch.arange(round(-8 / TABLE_STEP), round(8 / TABLE_STEP) + 1)
    known = torch.tensor(sorted(sums), dtype=torch.float64)
    values = torch.tensor([sums[b][0] / sums[b][1] for b in sorted(sums)], dtype=torch.float64)
    import numpy as np

    phi = np.interp(grid.double().numpy(), known.numpy(), values.numpy())  # fills the bins around 0 linearly
    lines = ["x,phi_4096"] + [f"{g * TABLE_STEP:.7f},{p:.3f}" for g, p in zip(grid.tolist(), phi.tolist())]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path} ({len(lines) - 1} rows; phi at -8: {phi[0]:.2f}/4096, at 0: {phi[len(phi) // 2]:.1f}, at 8: "
          f"{phi[-1]:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="matmul,softmax,sigmoid,gelu")
    parser.add_argument("--write-gelu-table", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from qexp.quant.htp_arithmetic import GELU_PHI_TABLE, gelu_phi_table
    from qexp.tracking.address import resolve_uri

    cfg, soc = emulator_config(args.overrides)
    if args.write_gelu_table:
        write_gelu_table(soc, GELU_PHI_TABLE)
        gelu_phi_table.cache_clear()

    results = {}
    for convert in [False, True] if "matmul" in args.ops.split(",") else []:
        probe = matmul_on_htp(convert, soc)
        print(f"matmul 16x16-bit, 32x64 by 64x128, b {'through a uint16 tensor (converted)' if convert else 'direct'} "
              f"(target=x86_emulator, {cfg.backend.soc.value}): HTP minus each model, in output codes")
        for model in ("fake_quant", "matmul_model"):
            results.update(report_row(f"matmul_{'converted' if convert else 'direct'}_{model}", model, probe["htp"],
                                      probe[model]))
    for op in [o for o in args.ops.split(",") if o != "matmul"]:
        for lo, hi in RANGES[op] if op != "softmax" else SOFTMAX_ROWS:
            if op == "softmax":
                probe = softmax_rows_on_htp(lo, hi, soc)
                what = f"rows of {lo} keys, scores std {hi:g}, causal mask"
            else:
                probe = all_codes_on_htp(op, lo, hi, soc)
                own = " (table's own)" if op == "gelu" and (lo, hi) in [s[:2] for s in TABLE_SOURCES] else ""
                what = f"inputs [{lo:g}, {hi:g}]{own}"
            name, candidate = reference_candidate(op, probe)
            print(f"{op} 16-bit, {what}, output step {probe['out'][0]:.3g} "
                  f"(target=x86_emulator, {cfg.backend.soc.value}): HTP minus each model, in output codes")
            for model, modelled in [("fake_quant", probe["fake_quant"]), ("htp_exact", probe["htp_exact"]),
                                    (name, candidate)]:
                results.update(report_row(f"{op}_{lo:g}_{hi:g}_{model}", model, probe["htp"], modelled))
            if op == "sigmoid":
                odd = (probe["htp"] % 2 == 1).double().mean().item()
                results[f"sigmoid_{lo:g}_{hi:g}_odd_codes"] = odd
                print(f"  HTP's odd output codes: {100 * odd:.1f}%")
    with benchmark_run(resolve_uri(cfg.tracking), "diag_htp_pointwise", "diag_htp_pointwise",
                       {"target": "x86_emulator", "soc": cfg.backend.soc.value}):
        mlflow.log_metrics({k.replace("-", "m").replace(".", "p"): v for k, v in results.items()})


if __name__ == "__main__":
    main()
