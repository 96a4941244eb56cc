"""RoleState: the delayed-scaling buffers of one scaled tensor (input, weight or grad).

Delayed scaling, per scaled tensor ("role": input, weight, grad):
  update()  once before each cast: step += 1; every `interval` steps the pending amax enters the
            history (slot 0), the representative amax is computed by `amax_compute_algo` and
            scale = max / (amax * margin). One op, no host sync (ops.delayed_scale_update).
  record()  after the cast: pending = max(pending, amax of the cast input); a non-finite amax is
            counted in `nonfinite_count` and never enters the history.
Under torch.distributed the casts of a training step record their amaxes locally, and one MAX
all-reduce over the recipe's process group at the end of the backward pass folds every rank's
records of every layer in (amax_reduction), so every buffer is identical on every rank between
steps: DDP's buffer broadcast and a checkpoint written by rank 0 lose nothing. A role
that steps with records of its own not yet reduced reduces first. record() itself, used where a
cast cannot record locally (a warm start under torch.distributed), all-reduces at once. A tensor
sharded by tensor parallelism (ScalingState.shard_over) has its amax all-reduced over the shards
too, for every recipe, so that each shard is cast with the scale of the whole tensor.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..formats import get_format
from ..ops.fused import record_amax, step_role
from .amax_all_reduce import all_reduce_amax
from .recipes import DelayedScaling, current_scale


# The buffers of a role, in the order fp8ops.ops.quantize_delayed takes them
BUFFERS = ("amax_history", "scale", "scale_inv", "amax_rep", "pending_amax", "step",
           "nonfinite_count")


class RoleState(nn.Module):
    """Delayed-scaling buffers of one scaled tensor. All updates are in place, on device."""

    # the 1-D DeviceMesh this role's tensor is sharded over (tensor parallelism), or None
    shard_mesh = None

    def __setattr__(self, name: str, value) -> None:
        if name == "started":  # set by every live forward: a plain bool, without Module's checks
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def __init__(self, history_len: int, device=None, batch: tuple = ()):
        """batch: leading dimensions of every buffer, for a batch of roles (a grouped layer's
        experts, ExpertRoleState)."""
        super().__init__()
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("amax_history", torch.empty(*batch, history_len, **f32))
        self.register_buffer("scale", torch.empty(batch, **f32))
        self.register_buffer("scale_inv", torch.empty(batch, **f32))
        self.register_buffer("amax_rep", torch.empty(batch, **f32))
        self.register_buffer("pending_amax", torch.empty(batch, **f32))
        self.register_buffer("step", torch.empty(batch, **i64))
        self.register_buffer("nonfinite_count", torch.empty(batch, **i64))
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """The initial state, in place (after to_empty() the buffers hold garbage)."""
        for buf in (self.amax_history, self.amax_rep, self.pending_amax, self.step,
                    self.nonfinite_count):
            buf.zero_()
        self.scale.fill_(1.0)
        self.scale_inv.fill_(1.0)
        # no amax recorded yet: casts take a warm scale (warm_scale). Set by the forward code
        # (outside autograd Functions, where torch.compile allows the mutation)
        self.started = False

    def extra_repr(self) -> str:
        if self.scale.device.type == "meta":
            return "meta"
        hist = self.amax_history.tolist()
        shown = ", ".join(f"{v:.4g}" for v in hist[:4]) + (", ..." if len(hist) > 4 else "")
        return (f"scale={self.scale.item():.6g}, amax={self.amax_rep.item():.6g}, "
                f"pending_amax={self.pending_amax.item():.6g}, step={self.step.item()}, "
                f"nonfinite={self.nonfinite_count.item()}, history=[{shown}]")

    @torch.no_grad()
    def update(self, recipe: DelayedScaling, fmt, margin: Optional[float] = None) -> None:
        """One step of the state machine; margin defaults to the recipe's (the grad role passes
        grad_margin). (ops.quantize_delayed does the same inside a cast.)"""
        step_role(self.amax_history, self.scale, self.scale_inv, self.amax_rep,
                  self.pending_amax, self.step, get_format(fmt).max,
                  recipe.margin if margin is None else margin, recipe.interval,
                  recipe.amax_compute_algo, recipe.ema_alpha, recipe.percentile,
                  recipe.power_of_two)

    @torch.no_grad()
    def record(self, amax: torch.Tensor, process_group=None, recipe=None) -> None:
        """Record amax, all-reduced over the process group first (recipe: the caller's, checked
        against the other ranks' before the group's first collective)."""
        self.record_reduced(*all_reduce_amax(amax, process_group, self.shard_mesh, recipe))

    @torch.no_grad()
    def record_reduced(self, amax: torch.Tensor, finite: torch.Tensor) -> None:
        """record() of an amax already reduced over the ranks (finite: whether every rank's was)."""
        record_amax(self.pending_amax, self.nonfinite_count, amax, finite)

    @torch.no_grad()
    def warm_scale(self, x: torch.Tensor, fmt, margin: float, recipe) -> torch.Tensor:
        """The scale of a cast before the role has recorded anything: from x's own amax (over
        the process group), as current scaling would, instead of the initial 1.0."""
        amax, finite = all_reduce_amax(torch.ops.fp8ops.amax(x), recipe.process_group,
                                       self.shard_mesh, recipe)
        amax = torch.where(finite, amax, float("nan"))  # not finite: current_scale keeps 1.0
        return current_scale(amax, fmt, margin, recipe.power_of_two)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.started = bool((self.step > 0).any().item())  # one host read per load
