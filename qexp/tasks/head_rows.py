"""Run a static llama's output head on the positions a task call scores, not on all `ar_len` of them.

A task item is scored from a few positions of its call (a last-word item from one or two of its ~80), yet the graph
ends in the vocabulary projection of every position: for SmolLM2 a fifth of a call's arithmetic, for Gemma-3's
262,144-token vocabulary more than its decoder layers. Everything from the final norm's output to the logits works
position by position (the projection, the logit scaling or soft-capping, and in a QDQ program per-tensor fake
quantization), so taking the wanted rows of the head's input gives those rows' logits as the full head computes
them (a test checks it on the float and the QDQ program).

Two kinds of program are handled: the float static llama (an `nn.Module` whose `output` is the head: it is wrapped
for the duration of a call) and a QDQ program (an exported `GraphModule`: an `index_select` is inserted in front of
the head's first op, reading the rows from a buffer). Anything else gets None and the caller keeps the full logits.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator, Optional, Protocol, Sequence

import torch

HEAD = "output"  # the static llama's attribute (and module path) of its output projection
_ROWS_BUFFER = "_qexp_head_rows"


class HeadRows(Protocol):
    def selecting(self, rows: Sequence[int]) -> ContextManager[None]:
        """While active, the program's logits are those of `rows` (positions of the call), in that order."""


class _Rows(torch.nn.Module):
    def __init__(self, head: torch.nn.Module, rows: torch.Tensor):
        super().__init__()
        self.head, self.rows = head, rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.index_select(1, self.rows))


class EagerHeadRows:
    """The float static llama: its `output` module is swapped for one that first takes the rows, during a call only
    (the module is shared with the perplexity phases)."""

    device = None  # where the scorer placed the module (qexp/tasks/packing.py); None: the CPU

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @contextmanager
    def selecting(self, rows: Sequence[int]) -> Iterator[None]:
        head = getattr(self.module, HEAD)
        setattr(self.module, HEAD, _Rows(head, torch.as_tensor(list(rows), dtype=torch.long, device=self.device)))
        try:
            yield
        finally:
            setattr(self.module, HEAD, head)


class GraphHeadRows:
    """A QDQ program whose graph the caller owns (qexp.quant.fold's copy): rewritten once, rows set per call; outside
    a call every row is taken, so the program still gives all its logits."""

    device = None  # as EagerHeadRows

    def __init__(self, module: torch.fx.GraphModule, entry: torch.fx.Node, ar_len: int):
        self.module, self.all_rows = module, torch.arange(ar_len)
        module.register_buffer(_ROWS_BUFFER, self.all_rows, persistent=False)
        graph = module.graph
        hidden = entry.args[0]
        with graph.inserting_before(entry):
            rows = graph.get_attr(_ROWS_BUFFER)
            taken = graph.call_function(torch.ops.aten.index_select.default, (hidden, 1, rows))
        shape = list(entry.args[1])
        shape[1] = -1
        entry.args = (taken, shape, *entry.args[2:])
        graph.lint()
        module.recompile()

    @contextmanager
    def selecting(self, rows: Sequence[int]) -> Iterator[None]:
        setattr(self.module, _ROWS_BUFFER, torch.as_tensor(list(rows), dtype=torch.long, device=self.device))
        try:
            yield
        finally:
            setattr(self.module, _ROWS_BUFFER, self.all_rows)


def _graph_entry(module: torch.fx.GraphModule, ar_len: int) -> Optional[torch.fx.Node]:
    """The head's first op: a reshape of the final hidden states [1, ar_len, dim] (the Conv2D head's first step), the
    first node the export attributes to the module `output`."""
    for node in module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        if list(stack.values())[-1][0] != HEAD:
            continue
        shape = node.args[1] if len(node.args) > 1 else None
        if ("reshape" in str(node.target) or "view" in str(node.target)) and isinstance(shape, (list, tuple)) \
                and len(shape) > 1 and shape[1] == ar_len:
            return node
        return None  # the head starts with something else: leave the program as it is
    return None


def head_rows(module, ar_len: int) -> Optional[HeadRows]:
    """How to run `module`'s head on chosen rows, or None where its layout is not the static llama's."""
    if isinstance(module, torch.fx.GraphModule):
        entry = _graph_entry(module, ar_len)
        return GraphHeadRows(module, entry, ar_len) if entry is not None else None
    if isinstance(getattr(module, HEAD, None), torch.nn.Module):
        return EagerHeadRows(module)
    return None
