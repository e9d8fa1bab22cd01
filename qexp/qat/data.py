"""QAT's training and validation sequences: the calibration half of the text, cut into sequences of the training
length. Never the evaluation text (its test half); the validation slice is the calibration half's last sequences, so
early stopping never sees the windows a run is scored on."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from qexp.data.windows import encode_prefix
from qexp.core.errors import InputError


@dataclass
class TrainingText:
    train: torch.Tensor  # [n, seq_len] int64, in training order (seeded shuffle)
    validation: torch.Tensor  # [m, seq_len] int64
    sha256: str  # of the training and validation ids, as trained
    source: str  # e.g. gensim-enwiki-excerpt:calibration
    available_tokens: int  # what the calibration half offers for training after the validation slice

    @property
    def train_tokens(self) -> int:
        return int(self.train.numel())


def training_text(text: str, source: str, tokenizer, add_bos: bool, seq_len: int, tokens: int,
                  validation_sequences: int, seed: int) -> TrainingText:
    """`tokens` training tokens (whole sequences, rounded up) and `validation_sequences` validation sequences of
    `seq_len` tokens from `text` (a calibration half). BOS starts each sequence when the model expects one."""
    body = seq_len - 1 if add_bos else seq_len
    ids = np.asarray(encode_prefix(text, tokenizer, len(text) + 1), dtype=np.int64)
    n_sequences = len(ids) // body
    rows = ids[: n_sequences * body].reshape(n_sequences, body)
    if add_bos:
        rows = np.concatenate([np.full((n_sequences, 1), tokenizer.bos_id, dtype=np.int64), rows], axis=1)
    wanted = -(-tokens // seq_len)
    available = n_sequences - validation_sequences
    if wanted > available:
        raise InputError(
            f"algorithm.qat.tokens={tokens} needs {wanted} sequences of {seq_len} tokens, and the calibration half of "
            f"{source} has {max(available, 0)} after the {validation_sequences} validation sequences "
            f"({max(available, 0) * seq_len} tokens)",
            "lower algorithm.qat.tokens or algorithm.qat.validation_sequences, or train on a longer text "
            "(calibration.text)")
    validation = rows[available:]
    order = np.random.default_rng(seed).permutation(available)[:wanted]
    train = rows[order]
    digest = hashlib.sha256(train.tobytes() + b"|" + validation.tobytes()).hexdigest()
    return TrainingText(torch.from_numpy(train), torch.from_numpy(validation.copy()), digest, source,
                        available * seq_len)
