"""What one call of a deployed graph streams from DRAM, from the model's shapes and the quant config: the weights as
the HTP program stores them, the KV caches it reads and its other inputs and outputs.

A decode step on HTP is bound by memory traffic: every weight of the decoder and the lm head is read once per call,
except the embedding table (a gather: one row). The static llama's attention reads both caches in full whatever
the position (its graphs have fixed shapes; the mask hides the empty slots), so the cache term grows with the
context the program was compiled for, not with the tokens generated so far. Weights as HTP stores them:
- b-bit integer codes, packed (4-bit: two per byte);
- one fp32 scale per output channel;
- LPBQ (per-block 4-bit, and per-channel 4-bit lowered as one block per row) adds one 4-bit integer scale per block.
QNN's own count (the DDR bandwidth summary of a compiled graph, qexp/speed/ddr.py) also includes activations that
leave the accelerator's memory; compiled programs use it where they have it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from qexp.quant.grid import activation_bits, grid_for, layer_linears

# Bytes of one output channel's fp32 scale, of one LPBQ block scale (a 4-bit multiple of the channel's unit).
CHANNEL_SCALE_BYTES = 4
BLOCK_SCALE_BYTES = 0.5
LOGITS_BYTES = 2  # 16-bit logits (every shipped scheme with 16-bit activations; 8-bit ones are rarer and smaller)


@dataclass(frozen=True)
class Shapes:
    """A decoder's shapes, as in config.json."""

    n_layers: int
    dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    qk_norm: bool = False  # an RMSNorm on each q and k head (Qwen3, Gemma 3: ModelArgs' use_qk_norm)

    @classmethod
    def of(cls, dims: dict) -> "Shapes":
        head_dim = dims.get("head_dim") or dims["dim"] // dims["n_heads"]
        return cls(int(dims["n_layers"]), int(dims["dim"]), int(dims["hidden_dim"]), int(dims["n_heads"]),
                   int(dims.get("n_kv_heads") or dims["n_heads"]), int(head_dim), int(dims["vocab_size"]),
                   bool(dims.get("use_qk_norm", False)))

    def linears(self) -> dict:
        """Meta-layout weight name -> (out, in), the lm head included (qexp.models.shapes.linear_shapes' layout)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = {"attention.wq": (q, self.dim), "attention.wk": (kv, self.dim), "attention.wv": (kv, self.dim),
                     "attention.wo": (self.dim, q), "feed_forward.w1": (self.hidden_dim, self.dim),
                     "feed_forward.w3": (self.hidden_dim, self.dim), "feed_forward.w2": (self.dim, self.hidden_dim)}
        shapes = {}
        for i in range(self.n_layers):
            names = layer_linears(i)
            for name in names:
                module = name.split(".", 2)[2].rsplit(".", 1)[0]
                shapes[name] = per_layer[module]
        shapes["output.weight"] = (self.vocab_size, self.dim)
        return shapes

    def linear_params(self) -> int:
        return sum(o * i for o, i in self.linears().values())


@dataclass(frozen=True)
class StreamBytes:
    """Bytes one graph call moves between DRAM and the accelerator."""

    weights: float  # every linear as stored (codes + scales), the lm head included
    lm_head: float  # the lm head's share of `weights`
    kv_cache: float  # both caches of every layer, read in full
    io: float  # the other graph inputs and outputs: new K/V rows written, logits, mask, the embedding rows gathered
    written: float = 0.0  # the part of `io` written (new K/V rows, logits)

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.io

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def weight_bytes(out: int, cols: int, grid) -> float:
    """One linear's bytes as HTP stores it (grid None: not quantized, fp32)."""
    if grid is None:
        return 4.0 * out * cols
    codes = out * cols * grid.bits / 8
    blocks = cols // grid.block_size if grid.block_size else (1 if grid.bits == 4 else 0)
    return codes + out * CHANNEL_SCALE_BYTES + out * blocks * BLOCK_SCALE_BYTES


def kv_bits(quant) -> int:
    """Bits of the KV caches: 8 with upstream's annotate_kv_8bit, else the scheme's activation bits."""
    from qexp.core.config import KV_8BIT_ANNOTATION

    if KV_8BIT_ANNOTATION in list(quant.custom_annotations):
        return 8
    return activation_bits(quant.scheme)


def stream_bytes(shapes: Shapes, quant, context: int, ar_len: int = 1, kv_bits_override: Optional[int] = None
                 ) -> StreamBytes:
    """Bytes of one call of the AR-`ar_len` graph of a program compiled for `context` tokens (the cache holds
    context - ar_len positions, as the static llama's)."""
    weights = lm_head = 0.0
    for name, (out, cols) in shapes.linears().items():
        size = weight_bytes(out, cols, grid_for(quant, name))
        weights += size
        if name == "output.weight":
            lm_head = size
    bits = kv_bits_override or kv_bits(quant)
    act = activation_bits(quant.scheme) / 8
    row = 2 * shapes.n_layers * shapes.n_kv_heads * shapes.head_dim * bits / 8  # one position of K and V
    cache = row * max(context - ar_len, 1)
    written = row * ar_len + ar_len * shapes.vocab_size * LOGITS_BYTES  # new K/V rows and the logits out
    io = (written
          + ar_len * context * 2  # the 16-bit attention mask in
          + ar_len * shapes.dim * act)  # the embedding rows gathered
    return StreamBytes(weights=weights, lm_head=lm_head, kv_cache=cache, io=io, written=written)


def weight_size(shapes: Shapes, quant) -> dict:
    """The weights as the HTP program stores them, one size measure for any recipe: average bits per decoder-linear
    weight (an LPBQ block's 4-bit scale counted, per-channel scales not), and MB of the decoder linears, the lm head
    and the embedding table (per tensor at the activation bits, as QnnQuantizer quantizes it) said apart."""
    from qexp.quant.grid import grid_bits

    decoder_bytes = decoder_weights = decoder_bits = lm_head_bytes = lm_head_bits = 0.0
    for name, (out, cols) in shapes.linears().items():
        grid = grid_for(quant, name)
        size, bits = weight_bytes(out, cols, grid), (32.0 if grid is None else grid_bits(grid))
        if name == "output.weight":
            lm_head_bytes, lm_head_bits = size, bits
        else:
            decoder_bytes += size
            decoder_weights += out * cols
            decoder_bits += out * cols * bits
    embedding_bits = 32 if grid_for(quant, "output.weight") is None else activation_bits(quant.scheme)
    return {"weight_bits_decoder": decoder_bits / decoder_weights, "weight_bits_lm_head": lm_head_bits,
            "weights_htp_decoder_mb": decoder_bytes / 1e6, "weights_htp_lm_head_mb": lm_head_bytes / 1e6,
            "weights_htp_embedding_mb": shapes.vocab_size * shapes.dim * embedding_bits / 8 / 1e6}
