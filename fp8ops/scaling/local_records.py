"""LocalRecords: which roles of a delayed-scaling state hold amax records made on this rank only.

Under torch.distributed a cast records its amax on its own rank, and the step's one MAX
all-reduce (amax_reduction.py) folds every rank's records in. ScalingState (a dense
layer's) and ExpertScalingState (a grouped layer's, an amax per expert) keep the same account of
what is still to fold, with this mixin: a role joins the set when it records locally and the set
empties once the all-reduce has run (or a checkpoint's buffers replace the records). A copy made
by pickling is outside the process group, so it carries no pending records.
"""
from __future__ import annotations

from typing import Optional

from . import amax_reduction


class LocalRecords:
    """The roles with amaxes recorded on this rank only since the last all-reduce."""

    def forget_local_records(self) -> None:
        """No record left to fold (a reset, a load, or the all-reduce itself)."""
        self._unreduced = set()

    def record_locally(self, role: str) -> None:
        """A cast of `role` recorded on this rank only (reduce_records folds the others in)."""
        self._unreduced.add(role)

    def needs_reduce(self, role: Optional[str] = None) -> bool:
        """Whether `role` (any role: None) holds records not yet reduced over the ranks."""
        return bool(self._unreduced) if role is None else role in self._unreduced

    def reduce_records(self) -> None:
        """Fold every rank's records in now: one MAX all-reduce over the recipe's process group
        (amax_reduction.reduce_states)."""
        amax_reduction.reduce_states([self])

    def records_reduced(self) -> None:
        """Every rank's records are folded in (called by amax_reduction)."""
        self.forget_local_records()

    def __getstate__(self):
        state = super().__getstate__()
        state["_unreduced"] = set()
        return state

    def __setstate__(self, state):
        state.setdefault("_unreduced", set())  # a pickle from before the records were local
        super().__setstate__(state)
