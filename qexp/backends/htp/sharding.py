"""Sharding a deployed graph into several QNN contexts at decoder-layer boundaries (upstream's --num_sharding)."""

from __future__ import annotations

from qexp.core.errors import ConfigError

LAYER_PATTERN = r"^layers\.(\d+)"  # the static llama's decoder layers (module names), where shards are cut


def check_num_sharding(num_sharding: int, n_layers) -> None:
    """backend.num_sharding must be 1 (no sharding) up to the model's decoder layers (None: not known yet)."""
    if num_sharding < 1 or (n_layers and num_sharding > n_layers):
        limit = f"1 to the model's {n_layers} layers" if n_layers else "1 or more"
        raise ConfigError(f"backend.num_sharding={num_sharding}", f"use {limit} (1 = no sharding)")


def shard_graph(passes: dict, deps: dict, n_layers: int, shares: int) -> None:
    """Cut the graph into `shares` QNN contexts at decoder-layer boundaries, as upstream's --num_sharding
    (TextDecoder.__init__): ExecuTorch's SplitGraph pass puts a `llama.fallback` identity op (run on the CPU) before
    every shard's first layer, after the QDQ nodes are folded and before the I/O is tagged (the cut edges stay
    quantized at the I/O bit width)."""
    from executorch.backends.qualcomm._passes import FoldQDQ, TagQuantIO
    from executorch.extension.llm.custom_ops.model_sharding import get_split_graph_pass

    split_graph, setting = get_split_graph_pass(n_layers, shares=shares, pattern=LAYER_PATTERN)
    passes[split_graph] = setting
    deps[split_graph] = [FoldQDQ]
    deps[TagQuantIO] = [split_graph]
