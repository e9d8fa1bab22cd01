"""Diagnostic: is a 16a4w HTP-vs-QDQ gap HTP's 4-bit kernels, or the model's fragility under 4-bit weights?

Puts every weight that 16a4w quantizes at 4 bits (q/k/v/o and the FFN projections) on the same symmetric per-row
4-bit grid ([-7, 7], max scaling) in float, then runs that model as 16a8w: the model is as degraded as a 16a4w one,
but the integers are nearly exactly representable on the 8-bit grid (error < 3% of a 4-bit step), so HTP runs it
through its 8-bit kernels. Prints HTP vs the same AR-N graph's CPU QDQ program on one window, to compare with the
16a4w run's `ppl_htp_vs_qdq` (x86 HTP emulator; a full SmolLM2 compile, ~10 min).

    .venv/bin/python diagnostics/diag_htp_w4_kernel.py [hydra overrides ...]
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import mlflow
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402

FOUR_BIT_WEIGHTS = re.compile(r"layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight$")


def on_4bit_grid(state_dict: dict) -> dict:
    out = dict(state_dict)
    for name, weight in state_dict.items():
        if FOUR_BIT_WEIGHTS.match(name):
            scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 7
            out[name] = (torch.round(weight / scale).clamp(-7, 7) * scale).to(weight.dtype)
    return out


def main() -> None:
    from hydra import compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)
    from qexp.backends.htp.graph import quantized_graph
    from qexp.backends.htp.lower import PREFILL_GRAPH, compile_pte
    from qexp.backends.htp.runner import HtpRunner
    from qexp.pipeline import prepare
    from qexp.core.provenance import library_versions
    from qexp.quant.calibrate import OBSERVERS
    from qexp.tracking.address import resolve_uri
    from qexp.transforms import ModelTransform, register_transform
    from qexp.upstream.private import tree_leaves

    @register_transform
    class OnFourBitGrid(ModelTransform):
        """The float weights 16a4w would quantize at 4 bits, put on that grid (a model transform: every graph the
        pipeline and the HTP backend build from the model sees it)."""

        name = "on_4bit_grid"

        def apply(self, model, context):
            return dataclasses.replace(model, state_dict=on_4bit_grid(model.state_dict))

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=16a8w_wikitext", "+algorithm.on_4bit_grid={}",
                                                        *sys.argv[1:]])
    state = prepare(cfg, through="qdq")
    model, static, qdq, context = state.deploy_model, state.deploy_static, state.qdq.program, cfg.export.max_context_len
    program = compile_pte(model, cfg, qdq, static.r3, state.cache, state.timer, library_versions())
    ids = state.windows.ids[0]
    htp = HtpRunner(program).prefill_logits(ids)

    # the same AR-N graph on CPU (fake-quant), fed its own KV cache chunk by chunk, as the HTP runner does
    ar = program.meta["graphs"][PREFILL_GRAPH]
    stats = torch.load(qdq.program_path.parent / OBSERVERS, weights_only=True)
    graph, chunked = quantized_graph(model, context, ar, static.r3, cfg.quant, cfg.observer, stats,
                                     cfg.model.recompose_hadamard, cfg.backend.soc.value)
    _, _, _, k_example, v_example = chunked.module.get_example_inputs()
    k_cache, v_cache = [torch.zeros_like(t) for t in k_example], [torch.zeros_like(t) for t in v_example]
    pieces, n_past, n_layers = [], 0, len(k_cache)
    with torch.no_grad():
        for start in range(0, len(ids), ar):
            chunk = list(ids[start : start + ar])
            tokens, _, positions, *_ = chunked.inputs(chunk, start_pos=n_past)
            mask = torch.full((1, 1, ar, context), -255.0)
            mask[..., :n_past] = 0
            mask[0, 0, :, context - ar :] = torch.where(torch.tril(torch.ones(ar, ar, dtype=torch.bool)), 0.0, -255.0)
            out = tree_leaves(graph(tokens, mask, positions, *k_cache, *v_cache))
            pieces.append(out[0].reshape(ar, -1)[: len(chunk)].float())
            if n_past + len(chunk) <= context - ar:
                for layer in range(n_layers):
                    k_cache[layer][..., n_past : n_past + len(chunk)] = out[1 + layer][..., : len(chunk)]
                    v_cache[layer][:, :, n_past : n_past + len(chunk)] = out[1 + n_layers + layer][:, :, : len(chunk)]
            n_past += len(chunk)
    cpu = torch.cat(pieces)

    targets = torch.as_tensor(ids[1:], dtype=torch.long)

    def ppl(logits):
        return torch.exp(-torch.log_softmax(logits[:-1].double(), -1).gather(1, targets[:, None]).mean()).item()

    summary = {"ppl_qdq": ppl(cpu), "ppl_htp": ppl(htp), "ppl_htp_vs_qdq": ppl(htp) / ppl(cpu) - 1,
               "top1_agreement_htp_vs_qdq": (htp.argmax(-1) == cpu.argmax(-1)).float().mean().item(),
               "tokens": len(ids) - 1}
    print(f"{cfg.model.name}: 4-bit-grid weights run as {cfg.quant.scheme} on HTP (target=x86_emulator)")
    for name, value in summary.items():
        print(f"  {name:28s} {value:.4g}")
    with benchmark_run(resolve_uri(cfg.tracking), f"diag_htp_w4_kernel-{cfg.model.name}", "diag_htp_w4_kernel",
                       {"target": "x86_emulator", "model": cfg.model.name}):
        mlflow.log_metrics(summary)


if __name__ == "__main__":
    main()
