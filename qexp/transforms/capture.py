"""Calibration activations at the inputs of each decoder layer's linears, for the algorithms that need them.

`LayerByLayer` runs the static llama (the module the FP phase scores) one decoder layer at a time over all
calibration samples: one forward records every layer's side inputs (RoPE tables, mask, caches) and the first
layer's input; after that, `run(i)` runs layer i on the current hidden states, returns what its linears read, and
(with `advance`) makes its outputs the next layer's inputs. So a whole model costs one pass, and an algorithm that
changes layer i's weights before advancing (GPTQ) gives layer i+1 the inputs of the already-quantized model.
Only the real tokens of each sample are kept (short prompt samples are right-padded to the graph's AR length).

On another device (the run's `device`) the static llama's tensors are swapped for device copies (the CPU tensors,
which a LoadedModel may share, are untouched), and the hidden states and captured inputs live there: an algorithm
computes on what `run` returns and brings its results back to the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional

import torch

if TYPE_CHECKING:  # the static llama imports ExecuTorch: not needed to validate a config
    from qexp.models.static_llama import StaticLlama

# The conv whose input is each shared input: q/k/v read the attention norm's output (captured at wq), o reads the
# attention output, gate/up read the FFN norm's output (captured at w1), down reads silu(gate) * up.
INPUTS = {"attn_in": "attention.wq_conv", "o_in": "attention.wo_conv", "ffn_in": "feed_forward.w1_conv",
          "down_in": "feed_forward.w2_conv"}


# which captured input each linear (Meta name) reads
INPUT_OF = {"wq": "attn_in", "wk": "attn_in", "wv": "attn_in", "wo": "o_in", "w1": "ffn_in", "w3": "ffn_in",
            "w2": "down_in"}


def input_of(meta_key: str) -> str:
    """The captured input a decoder layer's linear reads: `layers.3.feed_forward.w2.weight` -> "down_in"."""
    return INPUT_OF[meta_key.rsplit(".", 2)[1]]


class _StopForward(Exception):
    pass


class LayerByLayer:
    @torch.no_grad()
    def __init__(self, static: "StaticLlama", samples: Iterable, device: Optional[torch.device] = None):
        from qexp.core.device import move, to_device

        self.device = device or torch.device("cpu")
        if self.device.type != "cpu":
            move(static.module, self.device)  # for good: the static llama is the algorithm's own
        self.static = static
        self.layers = static.module.layers
        samples = list(samples)
        self.lengths: List[int] = [len(s) for s in samples]
        self.hidden: List[torch.Tensor] = []
        self.side: List[List[dict]] = []  # [sample][layer] -> the layer's keyword inputs
        recorded: List[dict] = []

        def record(index):
            def hook(_module, args, kwargs):
                if index == 0:
                    self.hidden.append(args[0].detach().clone())
                recorded.append(dict(kwargs))
                if index == len(self.layers) - 1:
                    raise _StopForward  # the final norm and lm head are not needed
            return hook

        handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        try:
            for sample in samples:
                recorded = []
                try:
                    static.module(*to_device(static.inputs(sample), self.device))
                except _StopForward:
                    pass
                self.side.append(recorded)
        finally:
            for handle in handles:
                handle.remove()
        self.next_layer = 0

    @torch.no_grad()
    def run(self, layer: int, inputs: Iterable[str] = tuple(INPUTS), advance: bool = True) -> Dict[str, torch.Tensor]:
        """{input name: [tokens, channels]} (fp32) of decoder layer `layer`'s linears over all samples."""
        if layer != self.next_layer:
            raise RuntimeError(f"layer {layer} run before its inputs exist (next is {self.next_layer})")
        block = self.layers[layer]
        captured: Dict[str, list] = {name: [] for name in inputs}
        current = {"n": 0}

        def hook_for(name):
            def hook(_module, args):
                x = args[0]
                rows = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])  # (1, C, H, W) -> [H*W tokens, C]
                captured[name].append(rows[: current["n"]].float().clone())
            return hook

        handles = [block.get_submodule(INPUTS[name]).register_forward_pre_hook(hook_for(name)) for name in captured]
        try:
            outputs = []
            for s, hidden in enumerate(self.hidden):
                current["n"] = self.lengths[s]
                outputs.append(block(hidden, **self.side[s][layer])[0])
        finally:
            for handle in handles:
                handle.remove()
        if advance:
            self.hidden = outputs
            self.next_layer += 1
        return {name: torch.cat(rows) for name, rows in captured.items()}
