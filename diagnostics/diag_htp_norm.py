"""Diagnostic: one RMSNorm of a model, lowered alone, on HTP vs its QDQ program, on the model's real inputs.

The op's inputs are captured in the float static llama (qexp's deploy model: Gemma's `(1 + w)` gains folded) on the
first evaluation window; half its positions calibrate a one-op 16a8w program (the op's activations at 16 bits, as
every scheme has them), the other half are compared. Each op is run three ways: as it is, with unit gains (is it the
gains?), and on Gaussian rows of the same per-position rms (is it the inputs' shape?). Prints HTP vs QDQ SQNR for the
whole tensor, the first position and the median of the others (`x86_emulator`), and QDQ vs fp32.

    .venv/bin/python diagnostics/diag_htp_norm.py model=gemma3_270m --module layers.8.ffn_norm

HTP's GELU, softmax and sigmoid over every input code: diagnostics/diag_htp_pointwise.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import emulator_config, quantized_on_htp  # noqa: E402
from diagnostics.sqnr import position_sqnrs_db  # noqa: E402
from qexp.eval.compare import sqnr_db  # noqa: E402


def on_htp(module: torch.nn.Module, calibration: torch.Tensor, test: torch.Tensor, soc):
    """(HTP's output, the QDQ program's output, fp32 output) of `module` quantized 16a8w on `calibration`."""
    htp, qdq = quantized_on_htp(module, (calibration,), (test,), soc)
    with torch.no_grad():
        return htp, qdq(test), module(test)


def captured_inputs(cfg, names: list) -> dict:
    """{name: (its input in the float static llama on the first evaluation window, [1, positions, dim]; the module)}."""
    from qexp.models.static_llama import window_logits
    from qexp.pipeline import prepare

    state = prepare(cfg, through="fp")
    static = state.fp_static
    captured, hooks = {}, []
    for name in names:
        hooks.append(static.module.get_submodule(name).register_forward_hook(
            lambda _module, args, _out, name=name: captured.setdefault(name, args[0].detach().clone())))
    with torch.no_grad():
        window_logits(static.module, static, list(state.windows.ids[0]))
    for hook in hooks:
        hook.remove()
    return {name: (x.reshape(1, -1, x.shape[-1]), static.module.get_submodule(name)) for name, x in captured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", default="layers.8.ffn_norm", help="RMSNorms of the static llama (comma list)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    cfg, soc = emulator_config(args.overrides)
    for name, (x, norm) in captured_inputs(cfg, args.module.split(",")).items():
        report_norm(cfg.model.name, name, x, norm, soc)


def report_norm(model_name: str, name: str, x: torch.Tensor, norm, soc) -> None:
    half = x.shape[1] // 2
    calibration, test = x[:, half:].contiguous(), x[:, :half].contiguous()  # position 0 (the sink) is compared
    gain = norm.weight.detach().float()
    print(f"{model_name} {name} (target=x86_emulator): input absmax {x.abs().max():.1f}, median position "
          f"rms {x.pow(2).mean(-1).sqrt().median():.2f}, gains [{gain.min():.3f}, {gain.max():.1f}]")

    def rms_like(t):
        generator = torch.Generator().manual_seed(0)
        return torch.randn(t.shape, generator=generator) * t.pow(2).mean(-1, keepdim=True).sqrt()

    for label, gains, calib, inputs in [("as it is", gain, calibration, test),
                                        ("unit gains", torch.ones_like(gain), calibration, test),
                                        ("Gaussian rows, same rms", gain, rms_like(calibration), rms_like(test))]:
        module = torch.nn.RMSNorm(gain.numel(), eps=norm.eps).eval()
        module.weight.data = gains.clone()
        htp, qdq, fp = on_htp(module, calib, inputs, soc)
        per_position = position_sqnrs_db(qdq, htp, tokens=qdq.shape[1])
        print(f"  {label:24s} HTP vs QDQ {sqnr_db(qdq, htp):5.1f} dB (position 0 {per_position[0]:.1f}, median of "
              f"the others {per_position[1:].median():.1f}); QDQ vs fp32 {sqnr_db(fp, qdq):5.1f} dB")


if __name__ == "__main__":
    main()
