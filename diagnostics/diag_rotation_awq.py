"""Diagnostic: why rotation + AWQ loses to round-to-nearest at LPBQ block scales (results/algorithms.md: 34.92 vs
RTN's 32.55 at block 32), while each helps on its own or per channel.

Weight-only quantization with float activations, so nothing but the weights differs: the float model, the rotated
one, AWQ's and rotation + AWQ's (qexp's own transforms, as a run applies them; AWQ with its clip search, as the
table's runs) are each scored on the run's evaluation windows

- in float (AWQ's clip changes the function on purpose: its share);
- with every quantized decoder linear rounded to nearest onto its QNN grid (the lm head and embedding stay float);
- with only one kind of linear quantized (q, k, v, o, gate, down, up), the rest float: which linears' quantization
  error the transform grew.

Each row's Δ is paired with the same row of the untransformed model (a 95% bootstrap interval over the windows).

With `--first-token`, for the untransformed and the rotated model with only the v projections quantized (`--kind`
another linear): the same evaluation with the first position's v (the attention sink's value) computed with float
weights, and with only the first position's v quantized; per layer, v's relative output error at the first position
and at the others. Whether v's loss under rotation is the sink's value (each layer's attention puts most of its
weight on position 0).
With `--first-token --stack rotation,weight_clip,gptq` (any stack whose last transforms quantize the weights), the
stack's own weights instead: its float perplexity, and the same with the first position's v (then every linear's
first-position output) computed with the rotated model's float weights: how much of what the stack still loses is
the sink's.

With `--layer-errors`, per layer instead, for the float and the rotated model: each linear's relative weight error
on its grid, the blocks' crest factor (absmax / rms) and its relative output error ||(Q - W) X||^2 / ||W X||^2 on
the first evaluation windows (X: the layer's float inputs in that model).

    .venv/bin/python diagnostics/diag_rotation_awq.py                        # SmolLM2, LPBQ block 32
    .venv/bin/python diagnostics/diag_rotation_awq.py quant=16a4w_block quant.block_size=64
    .venv/bin/python diagnostics/diag_rotation_awq.py --layer-errors
    .venv/bin/python diagnostics/diag_rotation_awq.py --first-token
    .venv/bin/python diagnostics/diag_rotation_awq.py --first-token --stack rotation,weight_clip,gptq \
        quant=16a4w_block quant.block_size=64 calibration.sampling=spread calibration.limit=128 \
        ++algorithm.weight_clip.objective=outputs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KINDS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="rtn,rotation,awq,rotation+awq",
                        help="algorithm stacks to compare ('rtn': the untransformed model)")
    parser.add_argument("--layer-errors", action="store_true", help="per-layer errors, float vs rotated (above)")
    parser.add_argument("--first-token", action="store_true", help="v's loss at the first position (above)")
    parser.add_argument("--kind", default="attention.wv", help="with --first-token: the linear quantized alone")
    parser.add_argument("--stack", default="", help="with --first-token: a weight-quantizing stack (above)")
    parser.add_argument("--windows", type=int, default=4, help="evaluation windows for --layer-errors")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir


    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    from benchmarks.common import weight_only_evaluation
    from qexp.eval.uncertainty import ppl_ratio_interval
    from qexp.pipeline import prepare
    from qexp.transforms import TransformContext, apply_transforms, build_transforms, model_transforms
    from qexp.quant.grid import grid_for, layer_linears

    overrides = args.overrides or ["quant=16a4w_block", "quant.block_size=32"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        algorithms = f"[{args.stack}]" if args.stack else "[rotation,awq]"
        cfg = compose("config", overrides=[f"algorithm={algorithms}", *overrides, "backend=none"])
    state = prepare(cfg, "calibration")  # calibration data as a run of this config has it
    if args.layer_errors:
        return layer_errors(cfg, state, args.windows)
    if args.first_token and args.stack:
        return first_token_of_stack(cfg, state, args.stack.split(","))
    if args.first_token:
        return first_token(cfg, state, args.kind)
    n_layers = state.model.params["n_layers"]
    linears = [(k, grid_for(cfg.quant, k)) for i in range(n_layers) for k in layer_linears(i)]
    linears = [(k, g) for k, g in linears if g is not None and g.bits < 16]
    print(f"{cfg.quant.scheme}, {linears[0][1].describe()}; {state.windows.n_windows} windows x {cfg.eval.seq_len} "
          f"tokens; weight-only, float activations, lm head float")

    subsets = {"float": [], "all quantized": [k for k, _ in linears],
               **{f"{kind} only": [k for k, _ in linears if f".{kind}." in k] for kind in KINDS}}
    results, grids, stacks = {}, dict(linears), args.models.split(",")
    for stack in stacks:
        names = [] if stack == "rtn" else stack.split("+")
        transforms = model_transforms(build_transforms({n: cfg.algorithm.get(n) or {} for n in names}))
        context = TransformContext(cfg, state.calibration, state.cache, state.timer)
        model = apply_transforms(state.model, transforms, context)  # none for "rtn": the model itself
        for subset, keys in subsets.items():
            weights = {k: grids[k].quantize(model.state_dict[k].float()).to(model.state_dict[k].dtype) for k in keys}
            results[stack, subset] = weight_only_evaluation(cfg, model, state.windows, weights, f"{stack}: {subset}")

    print(f"{'subset':16s} " + " ".join(f"{s:>32s}" for s in stacks))
    for subset in subsets:
        cells = []
        for stack in stacks:
            result, base = results[stack, subset], results[stacks[0], subset]
            ppl = result.metrics()["ppl"]
            if stack == stacks[0]:
                cells.append(f"{ppl:32.2f}")
                continue
            ci = ppl_ratio_interval(result.logprobs, base.logprobs)
            delta = ppl / base.metrics()["ppl"] - 1
            cells.append(f"{ppl:8.2f} {delta:+6.1%} [{ci['ci_low']:+.1%}, {ci['ci_high']:+.1%}]".rjust(32))
        print(f"{subset:16s} " + " ".join(cells), flush=True)


def first_token(cfg, state, kind: str) -> None:
    from benchmarks.common import weight_only_evaluation
    from qexp.eval.uncertainty import ppl_ratio_interval
    from qexp.transforms import TransformContext, apply_transforms, build_transforms
    from qexp.quant.grid import grid_for

    rotation = build_transforms({"rotation": cfg.algorithm.get("rotation") or {}})
    models = {"float": state.model,
              "rotated": apply_transforms(state.model, rotation, TransformContext(cfg, None, state.cache, state.timer))}
    n_layers = state.model.params["n_layers"]
    keys = [f"layers.{i}.{kind}.weight" for i in range(n_layers)]
    print(f"{cfg.quant.scheme}, {grid_for(cfg.quant, keys[0]).describe()}; {state.windows.n_windows} windows; "
          f"weight-only, only {kind} quantized, float activations")

    variants = {f"{kind} quantized": None, "position 0 float": slice(0, 1), "only position 0 quantized": slice(1, None)}
    results, errors = {}, {name: {} for name in models}
    for name, model in models.items():
        weights = {k: grid_for(cfg.quant, k).quantize(model.state_dict[k].float()).to(model.state_dict[k].dtype)
                   for k in keys}
        results[name, "float"] = weight_only_evaluation(cfg, model, state.windows, {}, f"{name}: float")
        for variant, positions in variants.items():
            def hook(static, model=model, positions=positions, e=errors[name] if positions is None else None):
                return float_positions(static, model, (kind,), positions, e)

            results[name, variant] = weight_only_evaluation(cfg, model, state.windows, weights,
                                                            f"{name}: {variant}", hook)

    print(f"{'':28s} {'untransformed':>34s} {'rotated':>34s}")
    for variant in ("float", *variants):
        cells = []
        for name in models:
            result, base = results[name, variant], results[name, "float"]
            ppl = result.metrics()["ppl"]
            ci = ppl_ratio_interval(result.logprobs, base.logprobs)
            cells.append(f"{ppl:8.2f} {ppl / base.metrics()['ppl'] - 1:+6.1%} "
                         f"[{ci['ci_low']:+.1%}, {ci['ci_high']:+.1%}]".rjust(34))
        print(f"{variant:28s} " + " ".join(cells))
    print(f"{kind}'s relative output error ||Q x - W x||^2 / ||W x||^2, position 0 | the others; "
          "untransformed | rotated")
    for i in range(n_layers):
        cells = [f"{e[i, 'first'][0] / e[i, 'first'][1]:.2e} {e[i, 'rest'][0] / e[i, 'rest'][1]:.2e}"
                 for e in errors.values()]
        print(f"{i:2d} | {cells[0]} | {cells[1]}", flush=True)


def float_positions(static, reference, kinds, positions: slice | None, errors: dict | None = None) -> None:
    """Forward hooks: each `kinds` linear (1x1 conv) of `static` computes `positions` with `reference`'s (a
    LoadedModel's) weights for that linear, on its actual input; the other positions as they are (positions=None:
    all as they are). With `errors` (one kind), the squared output error and the output energy against those weights,
    summed per (layer, "first" | "rest" positions)."""
    import torch.nn.functional as F

    for i in range(len(static.module.layers)):
        for kind in kinds:
            key = f"layers.{i}.{kind}.weight"
            name, w = static.static_layout(key, reference.state_dict[key].float())
            conv = static.module.get_submodule(name.removesuffix(".weight"))
            w = w.reshape(conv.weight.shape).to(conv.weight.dtype)

            def hook(module, inputs, out, w=w, i=i):  # out: [batch, channels, 1, positions]
                exact = F.conv2d(inputs[0], w, module.bias)
                if errors is not None:
                    for part, cut in (("first", slice(0, 1)), ("rest", slice(1, None))):
                        e = errors.setdefault((i, part), [0.0, 0.0])
                        e[0] += float((out - exact)[..., cut].pow(2).sum())
                        e[1] += float(exact[..., cut].pow(2).sum())
                if positions is None:
                    return None
                out = out.clone()
                out[..., positions] = exact[..., positions]
                return out
            conv.register_forward_hook(hook)


def first_token_of_stack(cfg, state, stack) -> None:
    from benchmarks.common import weight_only_evaluation
    from qexp.eval.uncertainty import ppl_ratio_interval
    from qexp.transforms import TransformContext, apply_transforms, build_transforms, model_transforms

    def transformed(names):
        transforms = model_transforms(build_transforms({n: cfg.algorithm.get(n) or {} for n in names}))
        return apply_transforms(state.model, transforms, TransformContext(cfg, state.calibration, state.cache,
                                                                          state.timer))

    reference, quantized = transformed([n for n in stack if n == "rotation"]), transformed(stack)
    attention = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    variants = {"float weights": (reference, ()), "the stack's weights": (quantized, ()),
                "position 0's v float": (quantized, ("attention.wv",)),
                "position 0's q, k, v, o float": (quantized, attention),
                "position 0 float in every linear": (quantized, (*attention, "feed_forward.w1", "feed_forward.w2",
                                                                 "feed_forward.w3"))}
    print(f"{cfg.quant.scheme}, {','.join(stack)}, {cfg.calibration.limit} calibration samples; "
          f"{state.windows.n_windows} windows; the stack's weights (float activations)")
    results = {}
    for variant, (model, kinds) in variants.items():
        hooks = (lambda static, kinds=kinds: float_positions(static, reference, kinds, slice(0, 1))) if kinds else None
        results[variant] = weight_only_evaluation(cfg, model, state.windows, {}, variant, hooks)
    base = results["float weights"]
    for variant, result in results.items():
        ppl, ci = result.metrics()["ppl"], ppl_ratio_interval(result.logprobs, base.logprobs)
        print(f"{variant:34s} {ppl:8.2f} {ppl / base.metrics()['ppl'] - 1:+6.1%} "
              f"[{ci['ci_low']:+.1%}, {ci['ci_high']:+.1%}]", flush=True)


def layer_errors(cfg, state, windows: int) -> None:
    from qexp.transforms import TransformContext, apply_transforms, build_transforms
    from qexp.transforms.capture import LayerByLayer, input_of
    from qexp.models.static_llama import StaticLlama
    from qexp.quant.grid import grid_for

    rotation = build_transforms({"rotation": cfg.algorithm.get("rotation") or {}})
    rotated = apply_transforms(state.model, rotation, TransformContext(cfg, None, state.cache, state.timer))
    ids = [[int(t) for t in w] for w in state.windows.ids[:windows]]
    models = {"float": state.model, "rotated": rotated}
    runners = {name: LayerByLayer(StaticLlama.private_copy(m, cfg.export.max_context_len, cfg.model), ids)
               for name, m in models.items()}
    print(f"{windows} windows; float | rotated: weight rel. error, block crest factor, output rel. error")
    for i in range(state.model.params["n_layers"]):
        inputs = {name: runner.run(i, advance=True) for name, runner in runners.items()}
        for kind in ("attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            key = f"layers.{i}.{kind}.weight"
            grid, cells = grid_for(cfg.quant, key), []
            for name, model in models.items():
                w, x = model.state_dict[key].float(), inputs[name][input_of(key)].float()
                q = grid.quantize(w)
                blocks = w.reshape(w.shape[0], -1, grid.block_size or w.shape[1])
                crest = float((blocks.abs().amax(-1) / blocks.pow(2).mean(-1).sqrt()).median())
                reference = x @ w.T
                cells.append(f"{float((q - w).pow(2).sum() / w.pow(2).sum()):.2e} {crest:.2f} "
                             f"{float((x @ (q - w).T).pow(2).sum() / reference.pow(2).sum()):.2e}")
            print(f"{i:2d} {kind:16s} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
