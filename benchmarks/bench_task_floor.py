"""The least time a task phase can take on this host: the projections' arithmetic alone, timed here.

A task phase runs every position of its packed calls through the decoder's projections (the static llama's 1x1
convolutions) and the head on the scored rows. This script packs the requests of qexp's two wikitext tasks as the
phases do (qexp/tasks/packing.py), times each projection once at the calls' width on this host, and sums: the
projections' time for all calls is a lower bound on a phase (attention, norms, the activations' fake quantization
and the log-softmax come on top). Printed beside one timed call of the float program and the 5-minute target for
FP + QDQ (`benchmarks/bench_tasks.py` measures the phases themselves). Logged as one run of the MLflow experiment
`benchmarks`.

    .venv/bin/python benchmarks/bench_task_floor.py                       # SmolLM2, all items
    .venv/bin/python benchmarks/bench_task_floor.py -- model=gemma3_270m  # another model
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGET_S = 5 * 60.0  # FP + QDQ


def _seconds(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def projection_seconds(module, inputs):
    """Per call: seconds of every 1x1 convolution of `module` on the inputs it gets in one call with `inputs` (the
    head on the scored rows only, where the scorer selects them), timed one distinct shape at a time; and the
    multiply-adds they do."""
    import torch

    seen = {}

    def record(conv, args, _output):
        key = (tuple(conv.weight.shape), tuple(args[0].shape))
        seen[key] = (seen[key][0] + 1, conv, args[0]) if key in seen else (1, conv, args[0])

    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    hooks = [conv.register_forward_hook(record) for conv in convs]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    seconds = macs = 0.0
    with torch.no_grad():
        for (weight, shape), (count, conv, x) in seen.items():
            seconds += count * _seconds(lambda: conv(x))
            macs += count * weight[0] * weight[1] * x.numel() // shape[1]
    return seconds, macs


def main() -> None:
    import qexp  # noqa: F401  (first: it sets the hub offline before lm-eval imports `datasets`)
    import mlflow

    from benchmarks.bench_task_head import _requests
    from benchmarks.common import benchmark_run
    from qexp.compose import compose
    from qexp.lm_eval_model import phase_program
    from qexp.tasks.lm import QexpLM
    from qexp.tasks.packing import blocks_of, pack
    from qexp.tracking.address import embedded_store_uri

    argv = sys.argv[1:]
    overrides = ["backend=none", *(argv[argv.index("--") + 1:] if "--" in argv else [])]
    cfg = compose(overrides)
    program = phase_program(overrides=" ".join(overrides), phase="fp")
    lm = QexpLM(program.scorer, program.tokenizer, program.add_bos)
    requests = [lm._request(*lm._encode_pair(*r.args)) for r in _requests(cfg, lm, 10**9)
                if r.request_type == "loglikelihood"]
    scorer = program.scorer
    blocks = blocks_of(requests, scorer.ar_len)
    calls = pack([len(b) for b in blocks], scorer.ar_len)
    positions = sum(len(b) for b in blocks)
    scored = sum(len(branch) + 1 for b in blocks for branch in b.branches)
    inputs, _ = scorer._inputs([blocks[i] for i in calls[0]])
    rows = list(range(round(scored / len(calls))))  # a call's share of the scored rows
    with scorer.head_rows.selecting(rows) if scorer.head_rows is not None else nullcontext():
        per_call_s, per_call_macs = projection_seconds(scorer.module, inputs)
    floor_s = per_call_s * len(calls)
    call_s = _seconds(lambda: scorer._logits(inputs, rows), 3)
    print(f"{cfg.model.name}: {len(requests)} requests in {len(calls)} calls of {scorer.ar_len} positions "
          f"({positions / (len(calls) * scorer.ar_len):.0%} filled, {scored} scored rows)")
    print(f"projections per call: {per_call_macs * 2 / 1e9:.1f} GFLOP in {per_call_s:.3f} s "
          f"({per_call_macs * 2 / per_call_s / 1e9:.0f} GFLOP/s); one whole float call {call_s:.3f} s")
    print(f"least time per phase (projections only): {floor_s:.0f} s; FP + QDQ at least {2 * floor_s:.0f} s "
          f"against the {TARGET_S:.0f} s target: {2 * floor_s / TARGET_S:.2f}x")
    with benchmark_run(embedded_store_uri(), "task_floor", "task_floor", {"args": " ".join(argv)}):
        mlflow.log_metrics({"calls": len(calls), "positions": positions, "scored_rows": scored,
                            "projection_s_per_call": per_call_s, "float_call_s": call_s,
                            "floor_phase_s": floor_s, "floor_ratio_to_target": 2 * floor_s / TARGET_S})


if __name__ == "__main__":
    main()
