"""Diagnostic: how far HTP's integer kernels are from the QDQ (fake-quant) program for one linear layer, by weight bits.

Takes one weight matrix of the model (default SmolLM2's layer-0 gate projection) and a Gaussian copy of it, quantizes
a single linear layer (as the 1x1 conv the static llama runs) with QnnQuantizer at 16a8w and 16a4w (per-channel
weights), lowers it to HTP, runs it on the x86 HTP emulator and prints the SQNR of HTP vs QDQ and of both vs fp32.
This is where the 16a4w HTP-vs-QDQ perplexity gap on SmolLM2 comes from
(docs/research/2026-11-21-htp-4bit-kernels-and-sensitivity.md), and the regression check of its fix: `16a4w_lpbq` is
the same 16a4w QDQ program lowered with qexp's default backend.w4_lowering=lpbq (measured: 67.0 dB per-channel ->
85.6 dB, as 16a8w's 86.0 dB); `16a4w_block` is qexp's block recipe (quant.block_size, LPBQ block scales as
quant.block_scale_rounding says).
Each scheme is also computed by the QDQ program with HTP's integer arithmetic (eval.htp_exact,
qexp/quant/htp_arithmetic.py): "HTP vs htp_exact" and the share of bit-exact outputs say how well that model predicts
the emulator.

    .venv/bin/python diagnostics/diag_htp_weight_bits.py [--weight layers.0.feed_forward.w1.weight] [overrides ...]
    .venv/bin/python diagnostics/diag_htp_weight_bits.py --inputs real model=gemma3_270m \
        --weight layers.0.feed_forward.w2.weight

--inputs real feeds the layer what it sees in the model instead of Gaussian rows: its inputs in the float model
(the run's static llama, a forward hook) on the run's calibration samples, the first ones to calibrate the
one-layer program and the last one, held out, to compare HTP with QDQ on (its 256 positions in batches of 32).
Only the model's own weight is used then (the Gaussian weight copy tests the weights' shape, not the inputs).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from pathlib import Path

import mlflow
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402


def sqnr_db(x: torch.Tensor, reference: torch.Tensor) -> float:
    noise = ((x - reference) ** 2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10((reference ** 2).sum().item() / noise)


def _channel_bias(error: torch.Tensor) -> float:
    """Share of the error's energy that is a constant offset per output channel (0: noise-like, 1: pure bias)."""
    per_channel_mean = error.mean(dim=0, keepdim=True)
    return (per_channel_mean.pow(2).sum() * error.shape[0] / error.pow(2).sum().clamp_min(1e-30)).item()


def _output_scale(qdq: torch.fx.GraphModule) -> float:
    """The scale of the layer's output encoding (the program's last activation quantize)."""
    quantizes = [n for n in qdq.graph.nodes if n.op == "call_function"
                 and str(n.target).startswith("quantized_decomposed.quantize_per_tensor")]
    return float(quantizes[-1].args[1])


class _OneLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def real_inputs(cfg, weight_key: str, batch: int = 32) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The weight `weight_key` of the run's model and the inputs of its linear in the float static llama on the run's
    calibration samples: (weight, [batch, in_features] rows of every sample but the last, the last sample's rows)."""
    from qexp.models.static_llama import window_logits
    from qexp.pipeline import prepare
    from qexp.models.shapes import static_module_path

    state = prepare(cfg, "calibration")
    static = state.fp_static
    conv = static.module.get_submodule(static_module_path(weight_key))
    seen = []
    # a 1x1 conv's input is [batch, channels, h, w]: one row per position, the channels last
    handle = conv.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].detach().movedim(1, -1).reshape(-1, args[0].shape[1]).clone()))
    per_sample = []
    for sample in state.calibration.samples:
        seen.clear()
        window_logits(static.module, static, sample)
        per_sample.append(torch.cat(seen)[: len(sample)].float())
    handle.remove()
    rows = torch.cat(per_sample[:-1])
    rows = rows[: len(rows) // batch * batch]
    held_out = per_sample[-1][: len(per_sample[-1]) // batch * batch]
    return state.model.state_dict[weight_key].float(), list(rows.split(batch)), held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight", default="layers.0.feed_forward.w1.weight")
    parser.add_argument("--block-size", type=int, default=32, help="16a4w_block's block size")
    parser.add_argument("--inputs", choices=("gaussian", "real"), default="gaussian",
                        help="Gaussian rows, or the layer's inputs in the float model on the calibration text")
    parser.add_argument("--schemes", default="16a8w,16a4w,16a4w_lpbq,16a4w_block")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp.cache import Cache
    from qexp.models.sources import load_model
    from qexp.backends.htp.qnn_sdk import ensure_qnn_sdk
    from qexp.tracking.address import resolve_uri

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=16a4w_wikitext", *args.overrides])
    cache = Cache(cfg.cache_dir)
    ensure_qnn_sdk(cache)
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        to_edge_transform_and_lower_to_qnn,
    )
    from qexp import upstream
    from qexp.upstream.private import lower_4bit_per_channel_as_lpbq
    from qexp.upstream.private_runtime import load_program
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qexp.quant.calibrate import weight_observers
    from qexp.quant.fold import with_weights_dequantized
    from qexp.quant.lpbq import quantize_observer_scales
    from qexp.quant.recipe import make_quantizer

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        block_cfg = compose(config_name="config", overrides=[
            "+experiment=16a4w_wikitext", *args.overrides, "quant=16a4w_block", f"quant.block_size={args.block_size}"])

    generator = torch.Generator().manual_seed(0)
    if args.inputs == "real":  # the run's own model load serves the weight too
        weight, calibration, held_out = real_inputs(cfg, args.weight)
        weights = {"model": weight}
        # one .pte input shape: the held-out rows in batches of 32, the first one also the export's example
        batches = list(held_out.split(32))
        x = (batches[0],)
    else:
        weight = load_model(cfg.model, cache).state_dict[args.weight].float()
        weights = {"model": weight, "gaussian": torch.randn(weight.shape, generator=generator) * weight.std()}
        calibration = [torch.randn(32, weight.shape[1], generator=generator) for _ in range(8)]
        x = (torch.randn(32, weight.shape[1], generator=generator),)
        batches = [x[0]]
    soc = getattr(QcomChipset, cfg.backend.soc.value)
    results = {}
    print(f"{cfg.model.name} {args.weight} {tuple(weight.shape)}, {args.inputs} inputs "
          f"({len(calibration)} calibration batches, {sum(len(b) for b in batches)} compared rows), "
          "target=x86_emulator")
    with tempfile.TemporaryDirectory() as tmp:
        for source, w in weights.items():
            # 16a4w_lpbq: the same 16a4w QDQ program, its per-channel 4-bit weights lowered as LPBQ with one block
            # per row (qexp's default HTP lowering, backend.w4_lowering=lpbq)
            for scheme in args.schemes.split(","):
                linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).eval()
                linear.weight.data = w.clone()
                # as the static llama runs it: a 1x1 conv (HTP's Conv2d kernels; LPBQ lowers convolutions only)
                layer = upstream.convert_linear_to_conv2d(_OneLinear(linear)).eval()
                if scheme == "16a4w_block":
                    quantizer = make_quantizer(block_cfg.quant, block_cfg.observer, cfg.backend.soc.value)
                else:
                    quantizer = QnnQuantizer(soc_model=soc)
                    quantizer.set_default_quant_config(getattr(QuantDtype, f"use_{scheme.removesuffix('_lpbq')}"),
                                                       is_linear_per_channel=True, is_conv_per_channel=True)
                prepared = prepare_pt2e(torch.export.export(layer, x, strict=False).module(), quantizer)
                for batch in calibration + ([x[0]] if args.inputs == "gaussian" else []):
                    prepared(batch)
                if scheme == "16a4w_block":
                    quantize_observer_scales(weight_observers(prepared).values(), block_cfg.quant.block_scale_rounding)
                qdq = convert_pt2e(prepared)
                exact = with_weights_dequantized(qdq, "per_channel" if scheme == "16a4w" else "lpbq")
                with lower_4bit_per_channel_as_lpbq() if scheme.endswith("_lpbq") else contextlib.nullcontext():
                    edge = to_edge_transform_and_lower_to_qnn(qdq, x, generate_qnn_executorch_compiler_spec(
                        soc_model=soc, backend_options=generate_htp_compiler_spec(use_fp16=False)))
                pte = Path(tmp) / f"{source}_{scheme}.pte"
                pte.write_bytes(edge.to_executorch().buffer)
                with torch.no_grad():
                    fp, reference, modelled = (torch.cat([f(b) for b in batches]) for f in (layer, qdq, exact))
                program = load_program(str(pte))
                htp = torch.cat([program.forward((b,))[0] for b in batches])
                error = htp - reference
                row = {"htp_vs_qdq_db": sqnr_db(htp, reference), "qdq_vs_fp_db": sqnr_db(reference, fp),
                       "htp_vs_fp_db": sqnr_db(htp, fp), "htp_vs_htp_exact_db": sqnr_db(htp, modelled),
                       # in the output's 16-bit steps: the two sides dequantize it with different float roundings
                       "htp_exact_bit_exact_share": (torch.round((htp - modelled) / _output_scale(qdq)) == 0)
                       .double().mean().item(),
                       "htp_exact_layers": exact.htp_counts.modelled,
                       # a systematic error (mean far from 0 relative to its spread) compounds over layers;
                       # noise does not
                       "htp_error_mean_over_rms": (error.mean() / error.pow(2).mean().sqrt().clamp_min(1e-30)).item(),
                       "htp_error_channel_offset_share": _channel_bias(error)}
                results.update({f"{args.inputs}_inputs_{source}_{scheme}_{k}": v for k, v in row.items()})
                print(f"  {source:8s} {scheme:10s}: HTP vs QDQ {row['htp_vs_qdq_db']:6.1f} dB | QDQ vs fp32 "
                      f"{row['qdq_vs_fp_db']:5.1f} dB | HTP vs fp32 {row['htp_vs_fp_db']:5.1f} dB | HTP error: "
                      f"mean/rms {row['htp_error_mean_over_rms']:+.3f}, "
                      f"per-channel offset share {row['htp_error_channel_offset_share']:.3f} | HTP vs htp_exact "
                      f"{row['htp_vs_htp_exact_db']:6.1f} dB, {100 * row['htp_exact_bit_exact_share']:5.1f}% "
                      f"of outputs identical", flush=True)
    with benchmark_run(resolve_uri(cfg.tracking), f"diag_htp_weight_bits-{cfg.model.name}", "diag_htp_weight_bits",
                       {"target": "x86_emulator", "weight": args.weight, "inputs": args.inputs}):
        mlflow.log_metrics(results)


if __name__ == "__main__":
    main()
