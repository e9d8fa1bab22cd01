"""Selection windows through the static llama from any decoder layer on, for one-group-at-a-time measurements.

`record()` runs every window once under the module's current weights (the base precision of a view) and keeps the
hidden states entering each decoder layer. `loglik(start)` then re-runs only layers `start`.. and the head: the
layers before `start` are replaced by stand-ins that hand over the kept hidden states. A change to layer L's
weights therefore costs (n_layers - L) layers and the lm head, not a whole forward, and no graph is exported.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, List

import numpy as np
import torch

from qexp.data.windows import Windows
from qexp.models.static_llama import StaticLlama


def perplexity(ll: np.ndarray) -> float:
    """Token perplexity of log-likelihoods [windows, predicted]."""
    return math.exp(-float(ll.sum()) / ll.size)


class _KeptLayer(torch.nn.Module):
    """A decoder layer stand-in: returns the kept input of the first re-run layer (the window's, set per window)."""

    def __init__(self):
        super().__init__()
        self.hidden = None

    def forward(self, *args, **kwargs):
        return self.hidden, [], []


class LayerReplay:
    def __init__(self, static: StaticLlama, windows: Windows, batch: int = 8):
        self.static = static
        self.module = static.module
        self.device = next(static.module.parameters()).device  # the run's device, where the caller put the module
        self.windows = windows
        # windows per forward call: one batched call is ~1.7x faster than one call per window on 2 cores (measured
        # with SmolLM2, 8 x 128 tokens) and gives the same logits
        self.chunks = [windows.ids[i : i + batch] for i in range(0, windows.n_windows, batch)]
        self.kept: List[List[torch.Tensor]] = []  # [chunk][layer] hidden states entering the layer (+ the final norm)

    @torch.no_grad()
    def record(self) -> np.ndarray:
        """Keep each layer's input under the current weights; the log-likelihoods [windows, predicted]."""
        self.kept = []
        current: List[torch.Tensor] = []

        def keep(_module, args):
            current.append(args[0].detach().clone())

        # each decoder layer's input, and the last layer's output (the final norm's input: what the lm head re-runs on)
        handles = [layer.register_forward_pre_hook(keep) for layer in self.module.layers]
        handles.append(self.module.norm.register_forward_pre_hook(keep))
        try:
            rows = []
            for ids in self.chunks:
                current = []
                rows.append(self._loglik_of(ids))
                self.kept.append(current)
        finally:
            for handle in handles:
                handle.remove()
        return np.concatenate(rows)

    @torch.no_grad()
    def loglik(self, start: int) -> np.ndarray:
        """Log-likelihoods [windows, predicted] re-running layers `start`.. on the kept inputs (0: everything;
        n_layers: only the final norm and the lm head)."""
        if start == 0:
            return np.concatenate([self._loglik_of(ids) for ids in self.chunks])
        if not self.kept:
            raise RuntimeError("record() first")
        with self._skipping(start) as stand_in:
            rows = []
            for c, ids in enumerate(self.chunks):
                stand_in.hidden = self.kept[c][start]
                rows.append(self._loglik_of(ids))
        return np.concatenate(rows)

    @contextmanager
    def _skipping(self, start: int) -> Iterator[_KeptLayer]:
        layers = self.module.layers
        original = list(layers)
        stand_in = _KeptLayer()
        try:
            for i in range(start):
                layers[i] = stand_in
            yield stand_in
        finally:
            for i in range(start):
                layers[i] = original[i]

    def batch_inputs(self, ids: np.ndarray) -> tuple:
        """The static llama's flat inputs for a batch of windows [B, T]: tokens stacked, the rest broadcast."""
        n_batch = ids.shape[0]
        tokens, *rest = self.static.inputs(ids[0])
        stacked = torch.zeros((n_batch, tokens.shape[1]), dtype=tokens.dtype)
        stacked[:, : ids.shape[1]] = torch.as_tensor(ids, dtype=tokens.dtype)
        return tuple(t.to(self.device) for t in (stacked, *[t.expand(n_batch, *t.shape[1:]) for t in rest]))

    def logits(self, ids: np.ndarray) -> torch.Tensor:
        """[B, T, vocab] logits of a batch of windows under the module as it is now."""
        out = self.module(*self.batch_inputs(ids))
        logits = out[0] if isinstance(out, (tuple, list)) else out
        return logits.reshape(ids.shape[0], self.static.ar_len, -1)[:, : ids.shape[1]].float()

    def _loglik_of(self, ids: np.ndarray) -> np.ndarray:
        first = self.windows.first_target
        logits = self.logits(ids)
        if not torch.isfinite(logits).all():
            raise FloatingPointError("non-finite logits in the sensitivity analysis")
        # float32 log-softmax: a float64 one over the vocabulary costs a tenth of a late layer's whole re-run, and
        # every delta compares two numbers computed the same way
        predictors = logits[:, first - 1 : -1]
        targets = torch.as_tensor(ids[:, first:], dtype=torch.long, device=self.device)
        picked = predictors.gather(-1, targets[..., None])[..., 0]
        return (picked - torch.logsumexp(predictors, dim=-1)).double().cpu().numpy()
