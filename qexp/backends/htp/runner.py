"""Run a static-llama HTP .pte through the ExecuTorch pybindings (on this machine: the x86_64 HTP emulator).

Inputs are quantized as the graphs expect: int32 tokens and positions, an attention mask quantized with the mask
input's encoding (the float mask is 0 to attend and -255 to mask: uint16 65535 / 0 with 16-bit activations, uint8
255 / 0 with 8-bit ones), uint8/uint16 KV caches (K as (1, n_kv, head_dim, cache_len), V as (1, n_kv, cache_len,
head_dim)); logits come back at the I/O bit width and are dequantized with the logits scale and zero point.
The KV caches are updated by one of the two mechanisms in qexp/backends/htp/kv_cache.py.

Decoding is greedy (one token per kv_forward call) or, in model_mode=lookahead, lookahead decoding
(qexp/backends/htp/lookahead.py)
through the same graph with a tree mask; the accepted rows' K/V are written through either updater.
"""

from __future__ import annotations

import logging
import time
from typing import List, Sequence

import torch

from qexp.backends.htp.kv_cache import UPDATERS, UpdateStats
from qexp.backends.htp.lookahead import LookaheadLayout, lookahead_decode
from qexp.backends.htp.lower import KV_GRAPH, PREFILL_GRAPH, DeployedProgram
from qexp.backends.bench import Generation, measure
from qexp.upstream.private_runtime import load_program

log = logging.getLogger("qexp")


PADDING_MASK_VALUE = -255.0  # the static llama's float mask: 0 attends, this masks (upstream masking_utils)


def mask_values(encodings: dict, name: str = "mask") -> tuple:
    """(attend, masked, dtype) of the quantized mask input: 0.0 and PADDING_MASK_VALUE through its encoding.
    Programs compiled before the encoding recorded its range are 16-bit (65535 / 0)."""
    scale, zero_point = encodings[name]
    qmin, qmax = encodings.get("mask_range", (0, 65535))

    def quantize(value: float) -> int:
        return int(min(max(round(value / scale) + zero_point, qmin), qmax))

    return quantize(0.0), quantize(PADDING_MASK_VALUE), torch.uint8 if qmax <= 255 else torch.uint16


def sliding_window_attend(attend: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
                          window: int) -> torch.Tensor:
    """The sliding-window layers' mask (Gemma 3): of what `attend` [queries, keys] allows, the keys less than `window`
    positions before the query, as upstream's create_sliding_window_attn_mask and transformers define it."""
    return attend & (query_positions[:, None] - key_positions[None, :] < window)


class HtpRunner:
    def __init__(self, deployed: DeployedProgram):
        self.deployed = deployed
        self.meta = deployed.meta
        self.module = load_program(deployed.pte_path)
        self.context = int(self.meta["context"])
        self.n_layers = int(self.meta["n_layers"])
        kv_meta = self.module.method_meta(KV_GRAPH)
        # Gemma 3's graphs take a second, sliding-window mask after the causal one (MultiScopeAwareLlamaModel).
        self.sliding_window = self.meta.get("sliding_window")
        self.n_masks = 2 if self.sliding_window else 1
        k_sizes = kv_meta.input_tensor_meta(2 + self.n_masks).sizes()  # (1, n_kv, head_dim, cache_len)
        self.n_kv, self.head_dim = int(k_sizes[1]), int(k_sizes[2])
        self.dtype = torch.uint8 if int(self.meta["kv_bits"]) == 8 else torch.uint16
        self.mask_values = {graph: mask_values(enc) for graph, enc in self.meta["encodings"].items()}
        self.window_mask_values = {graph: mask_values(enc, "window_mask")
                                   for graph, enc in self.meta["encodings"].items() if "window_mask" in enc}

    # ---- helpers
    def ar_len(self, graph: str) -> int:
        return int(self.meta["graphs"][graph])

    def new_cache(self, graph: str, updater: str = "smart_mask"):
        enc = self.meta["encodings"][graph]
        zero_points = ([zp for _, zp in enc["k"]], [zp for _, zp in enc["v"]])
        cache_len = self.context - self.ar_len(graph)
        return UPDATERS[updater](self.n_layers, self.n_kv, self.head_dim, cache_len, zero_points, self.dtype)

    def _run(self, graph: str, tokens: Sequence[int], cache, n_valid: int, positions=None, block_mask=None):
        """One graph call: tokens (right-padded to the AR length) after the cached ones. The block's own mask is
        causal, or `block_mask` ([ar, ar] bool, lookahead's tree) with explicit `positions`."""
        ar = self.ar_len(graph)
        padded = torch.zeros((1, ar), dtype=torch.int32)
        padded[0, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.int32)
        cache_len = self.context - ar
        attend = torch.zeros((ar, self.context), dtype=torch.bool)
        attend[:, :cache_len] = cache.attended(self.context)[:cache_len]
        attend[:, cache_len:] = torch.tril(torch.ones(ar, ar, dtype=torch.bool)) if block_mask is None else block_mask
        if positions is None:
            positions = cache.n_past + torch.arange(ar, dtype=torch.int32)
        positions = torch.as_tensor(positions, dtype=torch.int32).reshape(1, ar)
        masks = [attend]
        if self.sliding_window:
            keys = torch.cat([cache.slot_positions(), positions[0].long()])
            masks.append(sliding_window_attend(attend, keys, positions[0].long(), int(self.sliding_window)))
        values = [self.mask_values[graph], self.window_mask_values.get(graph)][: len(masks)]
        masks = [torch.where(m, on, off).to(dt).reshape(1, 1, ar, self.context)
                 for m, (on, off, dt) in zip(masks, values)]
        out = self.module.run_method(graph, (padded, *masks, positions, *cache.inputs()))
        scale, zero_point = self.meta["encodings"][graph]["logits"]
        logits = (out[0].to(torch.float32).reshape(ar, -1)[:n_valid] - zero_point) * scale
        k_out, v_out = out[1 : 1 + self.n_layers], out[1 + self.n_layers : 1 + 2 * self.n_layers]
        return logits, k_out, v_out

    # ---- evaluation paths
    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits of every position through prefill_forward, AR-N tokens per call (smart mask)."""
        ar = self.ar_len(PREFILL_GRAPH)
        cache = self.new_cache(PREFILL_GRAPH)
        pieces = []
        for start in range(0, len(ids), ar):
            chunk = list(ids[start : start + ar])
            logits, k_out, v_out = self._run(PREFILL_GRAPH, chunk, cache, len(chunk))
            pieces.append(logits)
            if start + ar < len(ids):
                cache.update(k_out, v_out, len(chunk))
        return torch.cat(pieces)

    def rows(self, inputs: Sequence[int], first: int, updater: str = "smart_mask") -> torch.Tensor:
        """Logits of positions first..len(inputs)-1 (a task request's scored rows), by the path the perplexity
        phase scores windows with: the AR-N prefill graph where the program has one, else kv_forward."""
        if PREFILL_GRAPH in self.meta["graphs"]:
            return self.prefill_logits(inputs)[first:]
        return self.kv_logits(inputs, updater)[0][first:]

    def kv_logits(self, ids: Sequence[int], updater: str = "smart_mask"):
        """Logits of every position through kv_forward, one token per call; returns (logits, cache stats)."""
        cache = self.new_cache(KV_GRAPH, updater)
        rows = []
        for index, token in enumerate(ids):
            logits, k_out, v_out = self._run(KV_GRAPH, [token], cache, 1)
            rows.append(logits)
            if index + 1 < len(ids):
                cache.update(k_out, v_out, 1)
        return torch.cat(rows), cache.stats


def _prefill(runner: "HtpRunner", prompt: Sequence[int], decode_cache) -> torch.Tensor:
    """The prompt through prefill_forward in AR-N chunks (hybrid / lookahead) or kv_forward token by token (kv),
    filling the decode cache; returns the last call's logits."""
    if PREFILL_GRAPH in runner.meta["graphs"]:
        ar = runner.ar_len(PREFILL_GRAPH)
        prefill_cache = runner.new_cache(PREFILL_GRAPH)
        for chunk_start in range(0, len(prompt), ar):
            chunk = list(prompt[chunk_start : chunk_start + ar])
            logits, k_out, v_out = runner._run(PREFILL_GRAPH, chunk, prefill_cache, len(chunk))
            if chunk_start + ar < len(prompt):
                prefill_cache.update(k_out, v_out, len(chunk))
            decode_cache.update(k_out, v_out, len(chunk))
        return logits
    for token in prompt:
        logits, k_out, v_out = runner._run(KV_GRAPH, [token], decode_cache, 1)
        decode_cache.update(k_out, v_out, 1)
    return logits


def _greedy(runner: "HtpRunner", token: int, n_new: int, cache) -> List[int]:
    """Plain greedy decoding through kv_forward, one token per call."""
    tokens = [token]
    for _ in range(n_new - 1):
        logits, k_out, v_out = runner._run(KV_GRAPH, [token], cache, 1)
        cache.update(k_out, v_out, 1)
        token = int(logits[-1].argmax())
        tokens.append(token)
    return tokens


def _lookahead(runner: "HtpRunner", prompt: Sequence[int], token: int, n_new: int, cache, layout):
    last = {}

    def forward(tokens, positions, block_mask):
        logits, last["k"], last["v"] = runner._run(KV_GRAPH, tokens, cache, len(tokens), positions, block_mask)
        return logits

    def commit(rows):
        cache.update(last["k"], last["v"], len(rows), rows)

    return lookahead_decode(forward, commit, prompt, token, cache.n_past, n_new, layout, max_past=cache.cache_len)


def _generate(runner: "HtpRunner", prompt: Sequence[int], n_new: int, updater: str,
              lookahead: LookaheadLayout | None = None) -> Generation:
    """One timed generation: prefill, then greedy decoding (one token per kv_forward call) or lookahead decoding."""
    decode_cache = runner.new_cache(KV_GRAPH, updater)
    start = time.perf_counter()
    token = int(_prefill(runner, prompt, decode_cache)[-1].argmax())
    prefill_end = time.perf_counter()
    decode_cache.stats = UpdateStats()  # per-token update cost of decoding only
    extras = {}
    if lookahead is not None:
        tokens, stats = _lookahead(runner, prompt, token, n_new, decode_cache, lookahead)
        extras.update(stats.metrics())
    else:
        tokens = _greedy(runner, token, n_new, decode_cache)
    end = time.perf_counter()
    extras.update({f"kv_{k}": v for k, v in decode_cache.stats.per_token().items()})
    return Generation(tokens, prefill_end - start, prefill_end - start, end - prefill_end, len(prompt), extras)


def lookahead_layout(runner: "HtpRunner", backend) -> LookaheadLayout:
    return LookaheadLayout(int(backend.ngram), int(backend.window), int(backend.gcap), runner.ar_len(KV_GRAPH))


def measure_speed(runner: "HtpRunner", prompt: Sequence[int], n_new: int, updater: str, warmup: int, repeats: int,
                  lookahead: LookaheadLayout | None = None):
    """TTFT, prefill and decode tokens/s (qexp/backends/bench.py), plus the KV update cost per decoded token; decoding
    is greedy, or lookahead decoding with that layout. Returns (metrics, tokens of the last run)."""
    metrics, last = measure(lambda: _generate(runner, prompt, n_new, updater, lookahead), warmup, max(repeats, 1))
    return metrics, last.tokens


def verify_lookahead(runner: "HtpRunner", prompt: Sequence[int], lookahead_tokens: List[int], updater: str) -> dict:
    """Greedy decoding of the same prompt through the same kv_forward graph (one token per call), compared with
    lookahead's output: equal tokens = lossless. Also its decode rate, for lookahead's speed-up on this target."""
    greedy = _generate(runner, prompt, len(lookahead_tokens), updater)
    same = 0
    while same < len(greedy.tokens) and greedy.tokens[same] == lookahead_tokens[same]:
        same += 1
    greedy_rate = greedy.n_decoded / greedy.decode_s if greedy.decode_s > 0 else float("nan")
    return {"lookahead_matches_greedy": float(same == len(greedy.tokens)),
            "lookahead_greedy_prefix_tokens": float(same), "decode_tok_s_greedy": greedy_rate}
