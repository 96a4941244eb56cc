"""ExpertScalingState: the delayed-scaling state of a mixture-of-experts weight's grouped layer,
each expert with state of its own.

It is ScalingState's delayed-scaling part with a leading expert dimension: an ExpertRoleState for
the input (each expert's rows of X), the weight and the gradient (each expert's rows of dY), whose
buffers are RoleState's, [E, ...]. Expert g's slice goes through exactly what a dense layer's
RoleState goes through when that layer runs on expert g's rows alone: the same update (the dense
update's formulas over all experts at once, so the same bytes), the same amax record (an expert
with no rows records 0, as a dense layer given an empty input does), the same warm start.

Under torch.distributed the records go as the dense layers' do (scaling/role.py): a cast records
each expert's amax on its own rank (record_locally), and the one MAX all-reduce at the end of the
backward pass (amax_reduction.py) folds every rank's records of every expert in,
with the dense layers' records, so that every buffer is identical on every rank between steps.
An expert that got no tokens on one rank records 0 there, which the MAX leaves out: each expert
steps as it would in one process that ran the rows of all ranks together. A warm start (nothing
recorded yet) casts with each expert's amax all-reduced over the ranks, for the same reason.
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Optional

import torch
from torch import nn

from ..formats import get_format
from ..ops import emulation
from ..ops.fused import record_amax
from .amax_all_reduce import all_reduce_amax
from .local_records import LocalRecords
from .recipes import DelayedScaling, current_scale
from .role import RoleState
from .weight_cache import WeightCache

logger = logging.getLogger("fp8ops.modules")


class ExpertRoleState(RoleState):
    """RoleState's buffers for E experts: amax_history [E, L], scale, scale_inv, amax_rep,
    pending_amax [E] (float32), step, nonfinite_count [E] (int64). All updates in place, on
    the device, with no host sync."""

    def __init__(self, num_experts: int, history_len: int, device=None):
        super().__init__(history_len, device, batch=(num_experts,))

    def extra_repr(self) -> str:
        return f"experts={self.scale.shape[0]}, history={self.amax_history.shape[1]}"

    @torch.no_grad()
    def update(self, recipe: DelayedScaling, fmt, margin: float) -> None:
        """One step of every expert's state machine at once: the dense update's tensor
        formulas over the experts' histories [E, L] (each expert's bytes are the dense role's;
        a fixed number of ops, none per expert)."""
        self.step.add_(1)
        outs = emulation.delayed_scale_update(
            self.amax_history, self.scale, self.amax_rep, self.pending_amax, self.step,
            get_format(fmt).max, margin, recipe.interval, recipe.amax_compute_algo,
            recipe.ema_alpha, recipe.percentile, recipe.power_of_two)
        torch._foreach_copy_([self.amax_history, self.scale, self.scale_inv, self.amax_rep,
                              self.pending_amax], list(outs))

    @torch.no_grad()
    def record(self, amax: torch.Tensor) -> None:
        """pending = max(pending, amax) per expert; a non-finite amax is counted instead."""
        record_amax(self.pending_amax, self.nonfinite_count, amax, torch.isfinite(amax))

    @torch.no_grad()
    def warm_scale(self, amax: torch.Tensor, fmt, margin: float, recipe) -> torch.Tensor:
        """Each expert's scale before the role has recorded anything, from its amax [E] of this
        rank MAX-reduced over the recipe's process group (1.0 where any rank's is not finite), as
        current scaling: what one process casting every rank's values would take."""
        amax, finite = all_reduce_amax(amax, recipe.process_group, recipe=recipe)
        amax = torch.where(finite, amax, float("nan"))
        return current_scale(amax, fmt, margin, recipe.power_of_two)


class ExpertScalingState(LocalRecords, nn.Module):
    """The delayed-scaling state of one grouped layer: `input`, `weight` and `grad`
    (ExpertRoleState), the warm-start choices, whether casts record (`recording`: False in eval
    mode), and the weight cache whose stepped cast a checkpoint keeps (`weight_cast_scale` [E],
    zeros when there is none to reuse: a scale is never 0), as ScalingState does."""

    ROLES = ("input", "weight", "grad")
    delayed = True  # (read by the dense layer's helpers: autograd.steps_state / takes_warm_scale)
    # no role of the experts is sharded by tensor parallelism (read by amax_reduction)
    shard_meshes = MappingProxyType({})

    def __init__(self, recipe: DelayedScaling, num_experts: int, device=None,
                 weight_cache: Optional[WeightCache] = None):
        super().__init__()
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"ExpertScalingState takes a DelayedScaling recipe, got "
                            f"{type(recipe).__name__}")
        self.recipe = recipe
        self.num_experts = num_experts
        n = recipe.amax_history_len
        self.input = ExpertRoleState(num_experts, n, device)
        self.weight = ExpertRoleState(num_experts, n, device)
        self.grad = ExpertRoleState(num_experts, n, device)
        self.weight_cache = WeightCache() if weight_cache is None else weight_cache
        self.recording = True
        self.register_buffer("weight_cast_scale",
                             torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.reset()

    def reset(self) -> None:
        """The initial state: fresh buffers, warm starts, no cast to reuse."""
        for role in self.ROLES:
            self._modules[role].reset()
        self.warm = {"input": True, "grad": True}
        self.weight_cache.invalidate()
        self.forget_local_records()  # (LocalRecords: under torch.distributed)

    def step_role(self, role: str, recipe: DelayedScaling, fmt, margin: float) -> None:
        """Step `role` of every expert; records of this rank alone are folded with the other
        ranks' first (its new scales must see them all)."""
        if self.needs_reduce(role):
            self.reduce_records()
        self._modules[role].update(recipe, fmt, margin)

    def record_role(self, role: str, amax: torch.Tensor) -> None:
        """Record each expert's amax [E] in `role`; under torch.distributed on this rank only,
        for the step's one all-reduce to fold in (amax_reduction)."""
        self._modules[role].record(amax)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.record_locally(role)

    def set_recording(self, on: bool) -> None:
        self.__dict__["recording"] = on

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with torch.no_grad():
            scale = self.weight_cache.saved_scale()
            if scale is None:
                self.weight_cast_scale.zero_()
            else:  # mid-accumulation: the scales of the cast the next forward reuses
                self.weight_cast_scale.copy_(scale)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if not any(key.startswith(prefix) for key in state_dict):
            # a checkpoint without FP8 state (a plain model's): load it with a fresh state
            self.reset()
            state_dict.update({prefix + k: v for k, v in self.state_dict().items()})
            logger.info("fp8ops: %s has no FP8 state in the checkpoint; its FP8 state starts "
                        "fresh", prefix.rstrip(".") or "ExpertScalingState")
        self.weight_cache.invalidate()
        self.forget_local_records()  # the checkpoint's buffers replace them
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        scale = state_dict.get(prefix + "weight_cast_scale")
        if (isinstance(scale, torch.Tensor) and tuple(scale.shape) == (self.num_experts,)
                and not scale.is_meta and bool((scale != 0).all().item())):
            self.weight_cache.restore(scale.to(self.weight.scale.device, torch.float32,
                                               copy=True))

    def _apply(self, fn, recurse=True):
        # .half() / .to(dtype) must not touch the float32 scales; device moves still apply
        def keep_dtype(t):
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(new.device)

        scale = self.weight_cache.saved_scale()  # the cast to reuse keeps its scales
        self.weight_cache.restore(None if scale is None else keep_dtype(scale))
        return super()._apply(keep_dtype, recurse)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}"
