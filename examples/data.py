"""The training text and its batches: the Python reference manual's topics (pydoc_data, shipped
with CPython: no download), as UTF-8 bytes (vocabulary 256)."""
from __future__ import annotations

import torch

VOCAB_SIZE = 256


def load_text() -> str:
    """The English text of the reference manual's help topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def load_tokens(val_fraction: float = 0.1):
    """(train, val) 1-D uint8->int64 byte tensors; the last `val_fraction` is held out."""
    data = torch.frombuffer(bytearray(load_text().encode("utf-8")), dtype=torch.uint8).long()
    n_val = int(len(data) * val_fraction)
    return data[:-n_val], data[-n_val:]


class Batches:
    """Random (input, target) windows of `seq_len` bytes; the order depends only on `seed`,
    so every run sees the same data in the same order."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]


def fixed_batches(tokens: torch.Tensor, n_batches: int, batch_size: int, seq_len: int,
                  seed: int):
    """A fixed list of batches (the validation set every run is evaluated on)."""
    b = Batches(tokens, batch_size, seq_len, seed)
    return [b.next() for _ in range(n_batches)]
