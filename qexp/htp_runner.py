"""Run a static-llama HTP .pte through the ExecuTorch pybindings (on this machine: the x86_64 HTP emulator).

Inputs are quantized as the graphs expect: int32 tokens and positions, a uint16 attention mask (65535 = attend,
0 = masked), uint8/uint16 KV caches (K as (1, n_kv, head_dim, cache_len), V as (1, n_kv, cache_len, head_dim));
logits come back uint16 and are dequantized with the logits scale and zero point.

Two KV-cache update mechanisms (the seeds' table):
- SmartMask: one buffer per layer; the new token's K/V is written at its position and the mask unmasks it.
- ShiftPointer: the cache input is a strided window into a flat buffer with one spare row (K) / head (V); each step
  the window's start pointer advances by one element (K) / one token row (V), the oldest entry drops out and the new
  one is written at the window's end; the mask attends to the last n_past slots.
Attention does not depend on the order of cached keys (RoPE is applied before caching), so both give the same
logits up to accumulation order.

Decoding is greedy (one token per kv_forward call) or, in model_mode=lookahead, lookahead decoding (qexp.lookahead)
through the same graph with a tree mask; the accepted rows' K/V are written through either updater.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import List, Sequence

import torch

from qexp.lookahead import LookaheadLayout, lookahead_decode
from qexp.lower import KV_GRAPH, PREFILL_GRAPH, DeployedProgram
from qexp.speed import Generation, measure

log = logging.getLogger("qexp")

ATTEND, MASKED = 65535, 0


@dataclass
class UpdateStats:
    seconds: List[float] = field(default_factory=list)  # one entry per update call
    bytes_written: int = 0
    tokens: int = 0  # tokens written (lookahead writes several per call)

    def per_token(self) -> dict:
        n = max(self.tokens, 1)
        return {"update_us_per_token": 1e6 * sum(self.seconds) / n, "update_bytes_per_token": self.bytes_written / n}


def _new_rows(k_out, v_out, n_new: int, rows):
    if rows is None:
        return k_out[..., :n_new], v_out[:, :, :n_new, :]
    index = torch.as_tensor(list(rows))
    return k_out.index_select(-1, index), v_out.index_select(2, index)


class SmartMaskCache:
    """Fixed buffers; write at the token's position, unmask it."""

    name = "smart_mask"

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, cache_len: int, zero_points, dtype):
        self.cache_len = cache_len
        k_zp, v_zp = zero_points
        self.k = [torch.full((1, n_kv, head_dim, cache_len), k_zp[i], dtype=dtype) for i in range(n_layers)]
        self.v = [torch.full((1, n_kv, cache_len, head_dim), v_zp[i], dtype=dtype) for i in range(n_layers)]
        self.n_past = 0
        self.stats = UpdateStats()

    def inputs(self):
        return [*self.k, *self.v]

    def mask_row(self, context: int) -> torch.Tensor:
        """Mask over [cache | new token(s)] for the current step (cache part only; caller adds the new block)."""
        row = torch.full((context,), MASKED, dtype=torch.uint16)
        row[: self.n_past] = ATTEND
        return row

    def update(self, k_out, v_out, n_new: int, rows: Sequence[int] | None = None) -> None:
        """Append n_new output rows (the first n_new, or `rows`: lookahead's accepted ones) at n_past."""
        start = time.perf_counter()
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k_new, v_new = _new_rows(k_out[layer], v_out[layer], n_new, rows)
            k[..., self.n_past : self.n_past + n_new] = k_new
            v[:, :, self.n_past : self.n_past + n_new, :] = v_new
            self.stats.bytes_written += (k_new.numel() + v_new.numel()) * k.element_size()
        self.n_past += n_new
        self.stats.tokens += n_new
        self.stats.seconds.append(time.perf_counter() - start)


class ShiftPointerCache:
    """Sliding windows over flat buffers: advancing the start pointer drops the oldest slot."""

    name = "shift_pointer"

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, cache_len: int, zero_points, dtype):
        self.n_kv, self.head_dim, self.cache_len = n_kv, head_dim, cache_len
        k_zp, v_zp = zero_points
        # K: n_kv * (head_dim + 1) rows of cache_len; each row's window slides into the next row's spent slots.
        self.k_flat = [torch.full((n_kv * (head_dim + 1) * cache_len,), k_zp[i], dtype=dtype) for i in range(n_layers)]
        # V: (n_kv + 1) heads of cache_len x head_dim; each head's window slides into the next head's spent rows.
        self.v_flat = [torch.full(((n_kv + 1) * cache_len * head_dim,), v_zp[i], dtype=dtype) for i in range(n_layers)]
        self.shift = 0  # tokens the pointers have advanced
        self.n_past = 0
        self.stats = UpdateStats()

    def _k_view(self, layer: int) -> torch.Tensor:
        cl, hd = self.cache_len, self.head_dim
        return self.k_flat[layer].as_strided(
            (1, self.n_kv, hd, cl), ((hd + 1) * cl * self.n_kv, (hd + 1) * cl, cl, 1), self.shift
        )

    def _v_view(self, layer: int) -> torch.Tensor:
        cl, hd = self.cache_len, self.head_dim
        return self.v_flat[layer].as_strided((1, self.n_kv, cl, hd), (0, cl * hd, hd, 1), self.shift * hd)

    def inputs(self):
        # The pybindings take contiguous tensors; on a device the runner passes the shifted pointers themselves.
        return [self._k_view(i).contiguous() for i in range(len(self.k_flat))] + [
            self._v_view(i).contiguous() for i in range(len(self.v_flat))
        ]

    def mask_row(self, context: int) -> torch.Tensor:
        row = torch.full((context,), MASKED, dtype=torch.uint16)
        if self.n_past:
            row[self.cache_len - self.n_past : self.cache_len] = ATTEND  # the newest n_past slots, at the end
        return row

    def update(self, k_out, v_out, n_new: int, rows: Sequence[int] | None = None) -> None:
        if self.shift + n_new > self.cache_len:
            raise RuntimeError("shift-pointer cache exhausted (more tokens than the context)")
        start = time.perf_counter()
        self.shift += n_new  # advance the start pointers: the oldest n_new slots leave the windows
        for layer in range(len(self.k_flat)):
            k_view, v_view = self._k_view(layer), self._v_view(layer)
            k_new, v_new = _new_rows(k_out[layer], v_out[layer], n_new, rows)
            k_view[..., self.cache_len - n_new :] = k_new
            v_view[:, :, self.cache_len - n_new :, :] = v_new
            self.stats.bytes_written += (k_new.numel() + v_new.numel()) * k_view.element_size()
        self.n_past += n_new
        self.stats.tokens += n_new
        self.stats.seconds.append(time.perf_counter() - start)


UPDATERS = {SmartMaskCache.name: SmartMaskCache, ShiftPointerCache.name: ShiftPointerCache}


class HtpRunner:
    def __init__(self, deployed: DeployedProgram):
        from executorch.extension.pybindings.portable_lib import _load_for_executorch

        self.deployed = deployed
        self.meta = deployed.meta
        self.module = _load_for_executorch(str(deployed.pte_path))
        self.context = int(self.meta["context"])
        self.n_layers = int(self.meta["n_layers"])
        kv_meta = self.module.method_meta(KV_GRAPH)
        k_sizes = kv_meta.input_tensor_meta(3).sizes()  # (1, n_kv, head_dim, cache_len)
        self.n_kv, self.head_dim = int(k_sizes[1]), int(k_sizes[2])
        self.dtype = torch.uint8 if int(self.meta["kv_bits"]) == 8 else torch.uint16

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
        mask = torch.full((1, 1, ar, self.context), MASKED, dtype=torch.uint16)
        mask[0, 0, :, :cache_len] = cache.mask_row(self.context)[:cache_len]
        if block_mask is None:
            block_mask = torch.tril(torch.ones(ar, ar, dtype=torch.bool))
        mask[0, 0, :, cache_len:] = torch.where(block_mask, ATTEND, MASKED).to(torch.uint16)
        if positions is None:
            positions = cache.n_past + torch.arange(ar, dtype=torch.int32)
        positions = torch.as_tensor(positions, dtype=torch.int32).reshape(1, ar)
        out = self.module.run_method(graph, (padded, mask, positions, *cache.inputs()))
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
    """TTFT, prefill and decode tokens/s (qexp.speed), plus the KV update cost per decoded token; decoding is greedy,
    or lookahead decoding with that layout. Returns (metrics, tokens of the last run)."""
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
