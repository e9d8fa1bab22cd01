"""The measurements of one sensitivity analysis on the selection windows, all in the float static llama with
fake-quantized weights (activations stay float: at 16 bits they are common to every recipe compared here; the
recipes are then checked by ordinary QDQ runs):

- `isolated_deltas`: each group alone at another grid than a base where every group has one grid, as a perplexity
  ratio to the base with its paired interval (qexp/eval/uncertainty.py). View "cost": base all high, the group low;
  view "gain": base all low, the group high (negative: promoting it helps).
- `float_pass`: one float pass that also measures, per group, the output SQNR of its module with the low and with
  the high grid on float inputs (what ExecuTorch's mix-precision analyzer ranks by), and the FIT / empirical Fisher
  proxy sum(E[g^2] * (w - q(w))^2) from the gradients of the selection loss.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from qexp.eval.uncertainty import ppl_ratio_interval
from qexp.sensitivity.groups import EMBEDDING, Group, grids_for
from qexp.sensitivity.replay import LayerReplay


class GroupWeights:
    """The float weights of the groups and a way to put any group on any grid, in the static llama in place."""

    def __init__(self, module: torch.nn.Module, groups: List[Group], program=None):
        params = dict(module.named_parameters())
        self.groups = groups
        self.program = program  # ProgramWeights: on its grid, these groups take the algorithms' weights
        self.params = {g.name: params[f"{g.module_path}.weight"] for g in groups}
        for p in self.params.values():
            # own storage per group: a tied lm head is a view of the embedding table, and putting one group on its
            # grid must not move the other (QnnQuantizer quantizes the two apart)
            p.data = p.data.clone()
        self.float = {name: p.detach().clone() for name, p in self.params.items()}

    def quantized(self, group: Group, grid) -> torch.Tensor:
        w = self.float[group.name]
        if grid is None:
            return w
        if self.program is not None and grid == self.program.grid and group.name in self.program.weights:
            return self.program.weights[group.name].reshape(w.shape).to(w.device)
        return grid.quantize(w.reshape(w.shape[0], -1)).reshape(w.shape)

    @torch.no_grad()
    def put(self, group: Group, grid) -> None:
        self.params[group.name].copy_(self.quantized(group, grid))

    @torch.no_grad()
    def put_all(self, grid_of: Callable[[Group], Optional[object]]) -> None:
        for group in self.groups:
            self.put(group, grid_of(group))


def start_layer(group: Group, n_layers: int) -> int:
    """The first layer a change to `group` reaches: the embedding feeds layer 0, the lm head follows the last."""
    if group.layer is not None:
        return group.layer
    return 0 if group.projection == EMBEDDING else n_layers


def isolated_deltas(replay: LayerReplay, weights: GroupWeights, groups: List[Group], low, high, view: str,
                    progress: Callable[[str], None] = lambda _: None) -> tuple[np.ndarray, List[Dict[str, float]]]:
    """Base log-likelihoods and, per group, {delta, ci_low, ci_high} of ppl(group changed) / ppl(base) - 1."""
    base_index, other_index = (1, 0) if view == "cost" else (0, 1)
    weights.put_all(lambda g: grids_for(g, low, high)[base_index])
    base = replay.record()
    n_layers = len(replay.module.layers)
    rows = []
    for i, group in enumerate(groups):
        grids = grids_for(group, low, high)
        weights.put(group, grids[other_index])
        try:
            ll = replay.loglik(start_layer(group, n_layers))
        finally:
            weights.put(group, grids[base_index])
        interval = ppl_ratio_interval(ll, base)
        rows.append({"delta": math.expm1(float((base - ll).sum()) / ll.size), "ci_low": interval.get("ci_low", np.nan),
                     "ci_high": interval.get("ci_high", np.nan)})
        progress(f"{view} {i + 1}/{len(groups)} {group.name}: {rows[-1]['delta']:+.4%}")
    return base, rows


@contextmanager
def _module_io(module: torch.nn.Module, paths: List[str], on_call: Callable) -> Iterator[None]:
    handles = [module.get_submodule(p).register_forward_hook(lambda m, a, out, p=p: on_call(p, m, a[0], out))
               for p in paths]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def float_pass(replay: LayerReplay, weights: GroupWeights, groups: List[Group], low, high) -> tuple[np.ndarray, Dict]:
    """Float log-likelihoods and, per group name, {sqnr_low_db, sqnr_high_db, fisher_low, fisher_high}."""
    weights.put_all(lambda g: None)
    module = replay.module
    by_path = {g.module_path: g for g in groups}
    quantized = {g.name: [weights.quantized(g, grid) for grid in grids_for(g, low, high)] for g in groups}
    power = {g.name: [0.0, 0.0, 0.0] for g in groups}  # ||y||^2, ||y - y_low||^2, ||y - y_high||^2

    @torch.no_grad()
    def measure(path, mod, x, y):
        group = by_path[path]
        acc = power[group.name]
        acc[0] += float(y.double().pow(2).sum())
        for k, w in enumerate(quantized[group.name]):
            if isinstance(mod, torch.nn.Embedding):
                y_q = torch.nn.functional.embedding(x, w)
            else:
                y_q = torch.nn.functional.conv2d(x, w)
            acc[1 + k] += float((y.double() - y_q.double()).pow(2).sum())

    grad_sq = {g.name: torch.zeros_like(weights.float[g.name]) for g in groups}
    first = replay.windows.first_target
    rows = []
    with _module_io(module, list(by_path), measure):
        for ids in replay.windows.ids:  # one window per backward: the Fisher proxy squares per-window gradients
            module.zero_grad(set_to_none=True)
            for p in weights.params.values():
                p.requires_grad_(True)
            with torch.enable_grad():
                logits = replay.logits(ids[None])[0]
                lp = torch.log_softmax(logits[first - 1 : -1].double(), dim=-1)
                ll = lp.gather(1, torch.as_tensor(ids[first:], dtype=torch.long, device=lp.device)[:, None])[:, 0]
                (-ll.sum()).backward()
            rows.append(ll.detach().cpu().numpy())
            for g in groups:
                grad = weights.params[g.name].grad
                if grad is not None:
                    grad_sq[g.name] += grad.detach().pow(2)
    for p in weights.params.values():
        p.requires_grad_(False)
        p.grad = None
    n = len(replay.windows.ids)
    stats = {}
    for g in groups:
        signal, err_low, err_high = power[g.name]
        fisher = [float((grad_sq[g.name] / n * (weights.float[g.name] - q).pow(2)).sum()) for q in quantized[g.name]]
        stats[g.name] = {"sqnr_low_db": _db(signal, err_low), "sqnr_high_db": _db(signal, err_high),
                         "fisher_low": fisher[0], "fisher_high": fisher[1]}
    return np.stack(rows), stats


def _db(signal: float, noise: float) -> float:
    return float("inf") if noise == 0 else 10.0 * math.log10(max(signal, 1e-300) / noise)

