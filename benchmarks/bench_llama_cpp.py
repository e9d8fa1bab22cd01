"""qexp's XNNPACK deployment side by side with llama.cpp on the same SmolLM2 GGUF, same threads, same windows.

    bash benchmarks/setup_llama_cpp.sh                      # once: builds llama-cpp-python (not in the main install)
    .venv/bin/python benchmarks/bench_llama_cpp.py           # 8da4w (4-bit, group 32) vs the GGUF's Q4_1 (group 32)
    .venv/bin/python benchmarks/bench_llama_cpp.py --qmode 8da8w --llama-cpp-type q8_0

Speed rounds alternate (qexp, llama.cpp, qexp, ...) so both see the same machine state; each round is one greedy
generation of --prompt-len + --new-tokens, timed with perf_counter around each engine's own calls (prefill: the
whole prompt in one call; decode: one call per token). Perplexity: both engines score the same token windows
(qexp's eval windows of the default text), lm-eval's token perplexity, next to the fp32 reference (the GGUF
dequantized, which is what qexp quantizes from: the shipped GGUF *is* Q4_1, so llama.cpp at q4_1 runs the
reference's own grid while qexp's 8da4w re-quantizes it). Prints and logs (MLflow `benchmarks`) the
ratios qexp / llama.cpp: decode and prefill tok/s (goal: decode >= 1.0) and perplexity.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import benchmark_run  # noqa: E402

from qexp.backends.bench import Generation, summarize  # noqa: E402


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


class LlamaCpp:
    """llama.cpp through llama-cpp-python: eval() of token ids, logits read back, our own timing."""

    def __init__(self, gguf: str, threads: int, context: int, logits_all: bool):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         logits_all=logits_all, n_batch=context, verbose=False)

    def window_logits(self, ids) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval([int(t) for t in ids])
        return torch.from_numpy(np.array(self.llm.scores[: len(ids)], dtype=np.float32))

    def _last_argmax(self) -> int:
        # `Llama.eval_logits` converts every stored row to Python lists on each access (seconds per token at
        # this vocab size); the scores array's last filled row is the same numbers.
        return int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))

    def generate(self, prompt, n_new: int) -> Generation:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval([int(t) for t in prompt])
        token = self._last_argmax()
        prefill_end = time.perf_counter()
        tokens = [token]
        for _ in range(n_new - 1):
            self.llm.eval([token])
            token = self._last_argmax()
            tokens.append(token)
        end = time.perf_counter()
        return Generation(tokens, prefill_end - start, prefill_end - start, end - prefill_end, len(prompt))


def quantize_gguf(source: str, kind: str, out_dir: str) -> str:
    """A requantized copy of the GGUF (llama.cpp's own quantizer), e.g. q8_0."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    out = str(Path(out_dir) / f"model-{kind}.gguf")
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {kind}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qmode", default="8da4w", help="qexp XNNPACK backend.qmode")
    parser.add_argument("--llama-cpp-type", default="q4_1", help="q4_1 = the shipped GGUF as is; or q8_0, f16, ...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per engine (after 2 warm-up rounds)")
    parser.add_argument("--eval-limit", type=int, default=4, help="perplexity windows (of eval.seq_len tokens)")
    args = parser.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: run `bash benchmarks/setup_llama_cpp.sh` first")

    from qexp.backends.xnnpack.export import export_program
    from qexp.backends.xnnpack.runner import XnnpackRunner
    from qexp.eval.perplexity import evaluate
    from qexp.models.sources import shipped_smollm2_gguf
    from qexp.pipeline import prepare
    from qexp.core.provenance import cpu_model, library_versions

    cfg = compose(["backend=xnnpack", "quant=fp32", f"backend.qmode={args.qmode}", f"backend.threads={args.threads}",
                   f"eval.limit={args.eval_limit}"])
    # The pipeline's stages through the FP phase: the model, the windows, and the fp32 reference (the dequantized
    # GGUF) on them (cached, shared with experiments on the same windows).
    state = prepare(cfg, through="fp")
    cache, model, windows, corpus = state.cache, state.model, state.windows, state.corpus
    ppl_fp = state.fp.metrics()["ppl"]
    del state
    prompt = [int(t) for t in windows.ids[0][: args.prompt_len]]
    context = max(windows.seq_len, args.prompt_len + args.new_tokens)

    print(f"[bench] qexp XNNPACK {args.qmode}: export (cached)", flush=True)
    program = export_program(model, cfg.backend, context, max(windows.seq_len, args.prompt_len), cache,
                             library_versions())
    qexp_runner = XnnpackRunner(program, args.threads)
    gguf = shipped_smollm2_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        if args.llama_cpp_type != "q4_1":
            gguf = quantize_gguf(gguf, args.llama_cpp_type, tmp)
        gguf_bytes = Path(gguf).stat().st_size
        peer_speed = LlamaCpp(gguf, args.threads, context, logits_all=False)
        peer_eval = LlamaCpp(gguf, args.threads, windows.seq_len, logits_all=True)

        print("[bench] perplexity on the same windows", flush=True)
        ppl_qexp = evaluate(qexp_runner.window_logits, windows, "qexp").metrics()["ppl"]
        ppl_peer = evaluate(peer_eval.window_logits, windows, "llama.cpp").metrics()["ppl"]

        print(f"[bench] speed: {args.rounds} alternating rounds of {args.prompt_len} + {args.new_tokens} tokens",
              flush=True)
        runs = {"qexp": [], "llama.cpp": []}
        engines = {"qexp": qexp_runner, "llama.cpp": peer_speed}
        for round_index in range(args.rounds + 2):
            for name, engine in engines.items():
                generation = engine.generate(prompt, args.new_tokens)
                if round_index >= 2:  # two warm-up rounds each
                    runs[name].append(generation)
        same_tokens = runs["qexp"][-1].tokens == runs["llama.cpp"][-1].tokens

    stats = {name: summarize(r) for name, r in runs.items()}
    table = pd.DataFrame({
        name: {"decode tok/s": s["decode_tok_s"], "decode tok/s p10": s["decode_tok_s_p10"],
               "prefill tok/s": s["prefill_tok_s"], "TTFT ms": s["ttft_ms"], "TTFT ms p90": s["ttft_ms_p90"]}
        for name, s in stats.items()
    })
    table.loc["perplexity"] = [ppl_qexp, ppl_peer]
    table.loc["perplexity fp32 reference"] = [ppl_fp, ppl_fp]
    table.loc["model MB"] = [program.pte_bytes / 1e6, gguf_bytes / 1e6]
    ratios = {
        "decode_ratio": stats["qexp"]["decode_tok_s"] / stats["llama.cpp"]["decode_tok_s"],
        "prefill_ratio": stats["qexp"]["prefill_tok_s"] / stats["llama.cpp"]["prefill_tok_s"],
        "ppl_ratio": ppl_qexp / ppl_peer,
    }
    print(f"\nqexp XNNPACK {args.qmode} vs llama.cpp {args.llama_cpp_type}, {args.threads} threads, {cpu_model()}, "
          f"target=cpu; {windows.n_windows} windows x {windows.seq_len} tokens ({corpus.source})")
    print(table.round(2).to_string())
    print(f"\nratios qexp / llama.cpp: decode {ratios['decode_ratio']:.3f} (goal >= 1.0), prefill "
          f"{ratios['prefill_ratio']:.3f}, perplexity {ratios['ppl_ratio']:.3f}; same greedy tokens: {same_tokens}")

    from qexp.tracking.address import embedded_store_uri

    store = os.environ.get("MLFLOW_TRACKING_URI") or embedded_store_uri()
    with benchmark_run(store, f"bench_llama_cpp-{args.qmode}-vs-{args.llama_cpp_type}", "bench_llama_cpp", {
        "target": "cpu", "cpu": cpu_model(), "qexp_qmode": args.qmode, "llama_cpp_type": args.llama_cpp_type,
        "text_source": corpus.source,
    }):
        mlflow.log_params({"threads": args.threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "rounds": args.rounds, "eval.n_windows": windows.n_windows,
                           "eval.window_len": windows.seq_len})
        mlflow.log_metrics({**ratios, "ppl_qexp": ppl_qexp, "ppl_llama_cpp": ppl_peer, "ppl_fp32_reference": ppl_fp,
                            **{f"qexp_{k}": v for k, v in stats["qexp"].items()},
                            **{f"llama_cpp_{k}": v for k, v in stats["llama.cpp"].items()}})
        mlflow.log_text(table.round(3).to_csv(), "comparison.csv")


if __name__ == "__main__":
    main()
