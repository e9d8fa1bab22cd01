"""ExecuTorch's two KV-cache update mechanisms for HTP (`backend.kv_update`), as the HTP runner drives them.

- SmartMask: one buffer per layer; the new token's K/V is written at its position and the mask unmasks it.
- ShiftPointer: the cache input is a strided window into a flat buffer with one spare row (K) / head (V); each step
  the window's start pointer advances by one element (K) / one token row (V), the oldest entry drops out and the new
  one is written at the window's end; the mask attends to the last n_past slots.
Attention does not depend on the order of cached keys (RoPE is applied before caching), so both give the same
logits up to accumulation order. Both count update time and bytes written per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Sequence

import torch



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

    def attended(self, context: int) -> torch.Tensor:
        """Which slots of [cache | new token(s)] the current step attends to (cache part only; the caller adds the
        new block)."""
        row = torch.zeros(context, dtype=torch.bool)
        row[: self.n_past] = True
        return row

    def slot_positions(self) -> torch.Tensor:
        """The token position each cache slot holds (meaningful where attended): a token is written at its own
        position. Sliding-window layers mask by the distance between positions."""
        return torch.arange(self.cache_len)

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

    def attended(self, context: int) -> torch.Tensor:
        row = torch.zeros(context, dtype=torch.bool)
        if self.n_past:
            row[self.cache_len - self.n_past : self.cache_len] = True  # the newest n_past slots, at the end
        return row

    def slot_positions(self) -> torch.Tensor:
        """The newest n_past slots hold positions 0 .. n_past-1, oldest first (see SmartMaskCache)."""
        return torch.arange(self.cache_len) - (self.cache_len - self.n_past)

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
