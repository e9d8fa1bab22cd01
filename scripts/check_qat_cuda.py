"""QAT's CUDA path against its CPU path: the same config trained once on each device, in one process on one machine
(a GPU machine is not always at hand, so this is a script to run there, not a test).

    python scripts/check_qat_cuda.py --out DIR [--devices cpu,cuda] [hydra overrides...]

The algorithms before QAT (e.g. `algorithm=[rotation,weight_clip,gptq,qat]`) run on the CPU on both passes, as in a
run. E.g. the tiny model: `model=tiny eval.seq_len=64 eval.limit=3 calibration.limit=3 algorithm=[qat]
algorithm.qat.tokens=1024 algorithm.qat.grad_accum=2 algorithm.qat.lr=1e-3`. Each device trains through qexp's own
load stage and QAT transform (with `algorithm.qat.device` set), in a fresh cache so neither reads the other's
result. DIR gets `<device>.json` per device (loss curves, metrics, each trained layer's
grid codes) and `comparison.json` / `comparison.md`: the largest difference between the loss curves, and how many
of the program's integer weights (round(w / s) on the trained scales, which the QDQ program holds, see
tests/test_qat.py) and scales agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def train_on(device: str, overrides: list, cache_dir: str) -> dict:
    from qexp.cache import Cache
    from qexp.compose import compose
    from qexp.data.calibration import build_calibration
    from qexp.data.text import calibration_corpus, load_corpus
    from qexp.models import load_model
    from qexp.core.provenance import pin_cpu_numerics
    from qexp.core.timing import StageTimer
    from qexp.transforms import TransformContext, apply_transforms, build_transforms, model_transforms
    from qexp.quant.grid import grid_for

    cfg = compose([*overrides, f"cache_dir={cache_dir}", f"algorithm.qat.device={device}"])
    transforms = model_transforms(build_transforms(cfg.algorithm))
    if not transforms or transforms[-1].name != "qat":
        raise SystemExit("check_qat_cuda: the overrides must end the algorithm list with qat, e.g. algorithm=[qat]")
    pin_cpu_numerics()  # as the pipeline does before its first stage
    cache = Cache(cache_dir)
    model = load_model(cfg.model, cache)
    # the stages QAT needs, as the pipeline runs them: load, the calibration set (part of the transform's key), the
    # transform; QAT builds its own teacher and reads its training text itself, so the FP phase is left out
    corpus = calibration_corpus(cfg.text, cfg.calibration.text, load_corpus(cfg.text, cache), cache)
    calibration = build_calibration(cfg.calibration, corpus, model.tokenizer, model.add_bos, cfg.export.max_context_len)
    context = TransformContext(cfg, calibration, cache, StageTimer(), reference=model)
    started = time.time()
    model = apply_transforms(model, transforms, context)
    seconds = time.time() - started
    outputs = context.outputs["qat"]
    codes, scales = {}, {}
    for key, ranges in model.weight_ranges.items():
        grid = grid_for(cfg.quant, key)
        if grid is None or grid.bits >= 16:
            continue
        scales[key] = ranges / grid.qmax
        weight = model.state_dict[key]
        codes[key] = torch.round(grid.quantize(weight, scales[key]) / _expand(scales[key], weight))
    return {"device": device, "seconds": seconds, "curves": outputs["metric_history"], "metrics": outputs["metrics"],
            "tags": outputs["tags"], "codes": codes, "scales": scales,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}


def _expand(scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-channel [out, 1] or per-block [out, in / block] scales broadcast to the weight's [out, in]."""
    scale = scale.reshape(weight.shape[0], -1)
    return scale.repeat_interleave(weight.shape[1] // scale.shape[1], 1)


def compare(a: dict, b: dict) -> dict:
    curves = {}
    for name, points in a["curves"].items():
        other = dict(b["curves"][name])
        diffs = [abs(v - other[s]) / max(abs(v), 1e-12) for s, v in points if s in other]
        curves[name] = {"points": len(points), "max_rel_diff": max(diffs) if diffs else None}
    codes_equal = sum(int((a["codes"][k] == b["codes"][k]).sum()) for k in a["codes"])
    codes_total = sum(a["codes"][k].numel() for k in a["codes"])
    off_by = max(int((a["codes"][k] - b["codes"][k]).abs().max()) for k in a["codes"])
    scale_rel = max(float(((a["scales"][k] - b["scales"][k]).abs() / a["scales"][k].abs().clamp_min(1e-12)).max())
                    for k in a["scales"])
    return {"devices": [a["device"], b["device"]], "curves": curves, "layers": len(a["codes"]),
            "same_layers": sorted(a["codes"]) == sorted(b["codes"]), "codes_equal_fraction": codes_equal / codes_total,
            "codes_max_abs_diff": off_by, "scales_max_rel_diff": scale_rel,
            "val_kd_best": [a["metrics"]["qat_val_kd_best"], b["metrics"]["qat_val_kd_best"]],
            "best_step": [a["metrics"]["qat_best_step"], b["metrics"]["qat_best_step"]],
            "train_seconds": [round(a["seconds"], 1), round(b["seconds"], 1)]}


def markdown(result: dict, overrides: list) -> str:
    lines = [f"# QAT on {result['devices'][1]} vs {result['devices'][0]}", "",
             f"torch {torch.__version__}, Python {platform.python_version()}, GPU {result.get('gpu')}", "",
             f"overrides: `{' '.join(overrides)}`", "",
             "| loss curve | points | largest relative difference |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['points']} | {v['max_rel_diff']:.2e} |" for k, v in result["curves"].items()]
    lines += ["", f"- trained layers: {result['layers']} (same set: {result['same_layers']})",
              f"- program integer weights equal: {result['codes_equal_fraction']:.6f} of them; largest difference "
              f"{result['codes_max_abs_diff']} step(s)", f"- scales: largest relative difference "
              f"{result['scales_max_rel_diff']:.2e}", f"- best validated step: {result['best_step']}; best val KD "
              f"{result['val_kd_best']}", f"- training seconds: {result['train_seconds']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    devices = args.devices.split(",")
    if "cuda" in devices and not torch.cuda.is_available():
        print("check_qat_cuda: torch sees no CUDA device; run it on a GPU machine or pass --devices cpu",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for device in devices:
        with tempfile.TemporaryDirectory(prefix=f"qat-{device}-") as cache:
            result = train_on(device, args.overrides, cache)
        results.append(result)
        saved = {k: v for k, v in result.items() if k not in ("codes", "scales")}
        (args.out / f"{device}.json").write_text(json.dumps(saved, indent=1, default=str))
        torch.save({"codes": {k: v.to(torch.int8) for k, v in result["codes"].items()}, "scales": result["scales"]},
                   args.out / f"{device}_program.pt")
        print(f"check_qat_cuda: {device}: {result['seconds']:.1f} s, val KD {result['metrics']['qat_val_kd_start']:.4f}"
              f" -> {result['metrics']['qat_val_kd_best']:.4f}", flush=True)
    if len(results) == 2:
        comparison = compare(*results)
        comparison["gpu"] = results[1]["gpu"] or results[0]["gpu"]
        comparison["torch"] = torch.__version__
        (args.out / "comparison.json").write_text(json.dumps(comparison, indent=1))
        (args.out / "comparison.md").write_text(markdown(comparison, args.overrides))
        print(markdown(comparison, args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
