"""What a region saves for backward, as autograd hands it to saved_tensors_hooks."""
from __future__ import annotations

import torch


class Saved:
    """The tensors saved for backward inside the context (saved_tensors_hooks), as they are."""

    def __init__(self):
        self.tensors = []

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def _pack(self, t):
        self.tensors.append(t)
        return t

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def of_dtype(self, *dtypes):
        return [t for t in self.tensors if t.dtype in dtypes]
