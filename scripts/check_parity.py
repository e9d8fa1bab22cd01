"""Every torch stage of a run on two devices of one machine (CPU and CUDA by default), in one process: the FP phase,
the algorithms and the transformed model's float evaluation, the calibration, the QDQ phase. Each device runs the
run's stages up to its QDQ phase (`qexp.pipeline.prepare`) in a fresh cache, so neither reads the other's results;
then, per stage, the perplexity on each device, their relative difference and whether the second device's
perplexity ratio to FP lies within the paired 95% interval of the first's, and the share of the QDQ program's integer
weights that are identical (with the largest difference in grid steps, and the layers that differ most).

A GPU machine is not always at hand, so this is a script to run there, not a test (it generalises
scripts/check_qat_cuda.py, which compares QAT's training curves). `--devices cpu,cpu` runs the comparison on a host
without a GPU: both passes must agree exactly, which checks the script itself.

    python scripts/check_parity.py --out DIR [--devices cpu,cuda] [hydra overrides...]
    python scripts/check_parity.py --out results/parity 'algorithm=[rotation,weight_clip,gptq]' \\
        algorithm.weight_clip.objective=outputs calibration.sampling=spread calibration.limit=128 eval.limit=32
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("fp", "fp_transformed", "qdq")  # the perplexities a run logs, in the order its stages compute them


def run_on(device: str, overrides: list) -> dict:
    import qexp  # noqa: F401 - pins the CPU kernels before any torch work
    from qexp.compose import compose
    from qexp.pipeline import prepare

    with tempfile.TemporaryDirectory(prefix=f"qexp-parity-{device}-") as cache:
        state = prepare(compose([*overrides, "backend=none", f"device={device}", f"cache_dir={cache}"]), "qdq")
    module = state.qdq.program.module if state.qdq is not None else None
    codes = {} if module is None else {name: t.clone() for name, t in module.named_buffers()
                                       if name.startswith("_frozen_param") and not t.is_floating_point()}
    result = {"device": device, "metrics": dict(state.metrics), "fp_logprobs": state.fp.logprobs,
              "seconds": {k[5:-2]: v for k, v in state.timer.metrics().items() if k.startswith("time_")},
              "codes": codes, "tags": {k: v for k, v in state.tags.items() if k.startswith(("device", "cuda"))}}
    del state, module
    gc.collect()
    return result


def compare(a: dict, b: dict) -> dict:
    from qexp.eval.uncertainty import ppl_ratio_interval

    stages = {}
    for phase in PHASES:
        ppl_a, ppl_b = a["metrics"].get(f"ppl_{phase}"), b["metrics"].get(f"ppl_{phase}")
        if ppl_a is None or ppl_b is None:
            continue
        row = {"ppl": [ppl_a, ppl_b], "rel_diff": ppl_b / ppl_a - 1}
        if phase == "fp":  # the two FP phases scored the same windows: their own paired interval
            interval = ppl_ratio_interval(b["fp_logprobs"], a["fp_logprobs"])
            row["interval"] = [interval.get("ci_low"), interval.get("ci_high")]
            row["within"] = bool(interval.get("ci_low", 0) <= 0 <= interval.get("ci_high", 0))
        else:  # each device's ratio to its own FP, against the first device's paired interval
            key = f"ppl_{phase}_vs_fp"
            low, high = a["metrics"].get(f"{key}_ci_low"), a["metrics"].get(f"{key}_ci_high")
            row["vs_fp"] = [a["metrics"][key], b["metrics"][key]]
            row["interval"] = [low, high]
            row["within"] = None if low is None else bool(low <= b["metrics"][key] <= high)
        stages[phase] = row
    codes = {"layers": len(a["codes"])}
    if a["codes"]:
        equal = sum(int((a["codes"][k] == b["codes"][k]).sum()) for k in a["codes"])
        total = sum(t.numel() for t in a["codes"].values())
        differing = {k: float((a["codes"][k] != b["codes"][k]).float().mean()) for k in a["codes"]}
        codes.update(equal_fraction=equal / total, max_step_diff=max(
            int((a["codes"][k].int() - b["codes"][k].int()).abs().max()) for k in a["codes"]),
            worst=sorted(((v, k) for k, v in differing.items() if v), reverse=True)[:5])
    return {"devices": [a["device"], b["device"]], "stages": stages, "integer_weights": codes,
            "seconds": [a["seconds"], b["seconds"]], "tags": [a["tags"], b["tags"]]}


def markdown(result: dict, overrides: list) -> str:
    first, second = result["devices"]
    lines = [f"# Parity: {second} against {first}", "", f"overrides: `{' '.join(overrides) or '(none)'}`; "
             f"torch {torch.__version__}; {result['tags'][1].get('device_name', second)}", "",
             f"| stage | ppl {first} | ppl {second} | relative difference | {first}'s paired 95% interval | within |",
             "|---|---|---|---|---|---|"]
    for phase, row in result["stages"].items():
        low, high = row["interval"]
        interval = "-" if low is None else f"[{low:+.3%}, {high:+.3%}]" + (" (vs each other)" if phase == "fp" else
                                                                             " (vs FP)")
        lines.append(f"| {phase} | {row['ppl'][0]:.6f} | {row['ppl'][1]:.6f} | {row['rel_diff']:+.2e} | {interval} "
                     f"| {row['within']} |")
    codes = result["integer_weights"]
    if codes["layers"]:
        lines += ["", f"QDQ program integer weights identical: {codes['equal_fraction']:.6f} of them over "
                  f"{codes['layers']} tensors; largest difference {codes['max_step_diff']} grid step(s)"]
        lines += [f"- {name}: {share:.4%} differ" for share, name in codes["worst"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    devices = args.devices.split(",")
    if len(devices) != 2:
        parser.error("--devices takes two devices, e.g. cpu,cuda")
    if "cuda" in devices and not torch.cuda.is_available():
        print(f"check_parity: torch {torch.__version__} sees no CUDA device; run it on a GPU machine or pass "
              "--devices cpu,cpu", file=sys.stderr)
        return 2
    results = []
    for device in devices:
        results.append(run_on(device, args.overrides))
        print(f"check_parity: {device}: " + ", ".join(f"ppl_{p} {results[-1]['metrics'][f'ppl_{p}']:.6f}"
                                                      for p in PHASES if f"ppl_{p}" in results[-1]["metrics"]),
              flush=True)
    comparison = compare(*results)
    text = markdown(comparison, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parity.json").write_text(json.dumps(comparison, indent=1, default=str))
    (args.out / "parity.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
