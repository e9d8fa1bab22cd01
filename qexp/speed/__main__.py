"""`python -m qexp.speed [--all-socs] [OVERRIDES...]`: the HTP speed estimate of a config, without compiling.

The overrides are the run's (`model=... quant=... backend.soc=SM8750 backend.prefill_ar_len=64
backend.bench.prompt_len=128 export.max_context_len=1024`); backend=htp is implied. The bytes come from the model's
shapes (its metadata: no weight is loaded) and the quant config; a compiled program's estimate (logged by every HTP
run) counts them with QNN's DDR summary instead, which adds what QNN moves besides weights and caches.
"""

from __future__ import annotations

import sys
from typing import List

from qexp.core.errors import ConfigError, QexpError


def compose(overrides: List[str]):
    """conf/config.yaml with `overrides`; the backend is HTP unless they choose one."""
    from qexp.compose import compose as compose_config

    if not any(o.startswith(("backend=", "+backend=")) for o in overrides):
        overrides = ["backend=htp", *overrides]
    return compose_config(overrides)


def check_deployable(cfg) -> None:
    """A config HTP cannot run, in one line: no HTP backend, no quantization, or a QDQ-only scheme."""
    from qexp.core.config import NO_QUANT, QDQ_ONLY_SCHEMES

    if cfg.backend.name != "htp":
        raise ConfigError(f"backend={cfg.backend.name}: the speed estimate is HTP's", "leave backend out (htp)")
    schemes = [cfg.quant.scheme, *(o.scheme for o in cfg.quant.overrides)]
    if NO_QUANT in schemes:
        raise ConfigError("quant=fp32: HTP runs quantized programs only", "choose e.g. quant=16a8w")
    bad = [s for s in schemes if s in QDQ_ONLY_SCHEMES]
    if bad:
        raise ConfigError(f"scheme {bad[0]} has 3-bit weights, which no HTP SoC runs (a QDQ-only research scheme)",
                          "use a 4-bit scheme, e.g. quant=16a4w")


def describe(cfg, soc: str) -> str:
    from qexp.backends.htp.config import ModelMode
    from qexp.speed import estimate_config, model_shapes

    backend = cfg.backend
    context = int(backend.max_seq_len)
    prefill_ar = None if backend.model_mode == ModelMode.kv else int(backend.prefill_ar_len)
    prompt = int(backend.bench.prompt_len)
    shapes = model_shapes(cfg.model)
    estimate, decode = estimate_config(shapes, cfg.quant, soc, context, prefill_ar, prompt)
    chunks = f"AR-{prefill_ar} chunks" if prefill_ar else "token by token (model_mode=kv)"
    return "\n".join([
        f"{cfg.model.name} quant={cfg.quant.name} on {soc}, context {context}, {backend.model_mode.value}: "
        f"{estimate.source}",
        f"  decode: {estimate.decode_tok_s:.0f} tok/s {estimate.interval('decode')} "
        f"({estimate.decode_ms_per_token:.2f} ms/token), median error {100 * estimate.decode_err:.0f}% "
        "(published figures, each predicted without its model's)",
        f"  TTFT:   {estimate.ttft_ms:.1f} ms {estimate.interval('ttft')} for a {prompt}-token prompt in {chunks} "
        f"(prefill {estimate.prefill_tok_s:.0f} tok/s), median error {100 * estimate.ttft_err:.0f}%"
        + (" (extrapolated: outside the model sizes the TTFT figures cover)" if estimate.ttft_extrapolated else ""),
        f"  bytes per decode step: {decode.total / 1e6:.1f} MB = weights {decode.weights / 1e6:.1f} "
        f"(lm head {decode.lm_head / 1e6:.1f}) + KV cache {decode.kv_cache / 1e6:.1f} + I/O {decode.io / 1e6:.2f}",
    ])


def main(argv: List[str]) -> int:
    all_socs = "--all-socs" in argv
    overrides = [a for a in argv if a != "--all-socs"]
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__.strip())
        return 0
    try:
        from qexp.speed import check_soc

        cfg = compose(overrides)
        check_deployable(cfg)
        if all_socs:
            from qexp.speed.data import published

            socs = published().socs_with_figures
        else:
            socs = [cfg.backend.soc.value]
            check_soc(socs[0])
        print("\n".join(describe(cfg, soc) for soc in socs))
        print("(an estimate, not a measurement; [low, high]: the 10-90% band of its held-out errors on published "
              "figures. docs/htp-speed.md says what it is fitted on and what it cannot know; a compiled program's "
              "estimate counts its bytes with QNN's DDR summary)")
    except QexpError as exc:
        print(f"qexp.speed: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bad override (Hydra) or unreadable metadata: one line, not a trace
        cause = f": {str(exc.__cause__).splitlines()[0]}" if exc.__cause__ else ""
        print(f"qexp.speed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}{cause}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
