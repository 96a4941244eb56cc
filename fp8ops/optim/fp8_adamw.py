"""FP8AdamW and FP8Adam: Adam's moments in FP8 with block scales (moments.py), the master being
the parameter itself in its own dtype.

- float32 parameters are their own float32 masters;
- bfloat16 parameters (`model.to(torch.bfloat16)`) are updated in float32 and stochastically
  rounded back to bf16 (fp8ops.ops.bf16_rounding), so no float32 copy exists anywhere.

The step's arithmetic is fixed, so that any implementation (this one, in PyTorch, on any
device; a fused kernel) gives the same bytes: docs/numerics.md, "FP8AdamW". The state is 2 bytes
a value with the default second moment (E4M3 m and sqrt(v), plus 8 bytes of scales per 128
values) against torch AdamW's 8.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer

from ..ops import adamw
from . import moments

_TORCH_STATE = ("exp_avg", "exp_avg_sq")
_FP8_STATE = ("m", "m_scale_inv", "v", "v_scale_inv")  # adamw_step_multi's lists, in order


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 and tensor parallelism), else t."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a reduction over the ranks), else t."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _buckets(members: list, states: list) -> dict:
    """The rows of `members` (a param group's (index, p) pairs) by what one adamw_step_multi
    call takes together: device, param dtype and the moments' format (float32 or FP8 with its
    second moment)."""
    buckets = {}
    for row, ((_, p), state) in enumerate(zip(members, states)):
        local = _local(p)
        key = (local.device, local.dtype, moments.form(state))
        buckets.setdefault(key, []).append(row)
    return buckets


def _contiguous_targets(params: list) -> list:
    """The local tensors the step writes: a non-contiguous local shard is stepped in a
    contiguous copy (copied back by _write_back)."""
    return [local if local.is_contiguous() else local.contiguous()
            for local in map(_local, params)]


def _write_back(params: list, targets: list) -> None:
    for p, target in zip(params, targets):
        local = _local(p)
        if target is not local:
            local.copy_(target)


def _step_fp8(params: list, states: list, scalars: torch.Tensor, rng: torch.Tensor) -> None:
    """One adamw_step_multi call for a bucket of parameters with FP8 moments."""
    targets = _contiguous_targets(params)
    # (a non-contiguous parameter's gradient has its strides; the CUDA op takes contiguous ones)
    grads = [g if g.is_contiguous() else g.contiguous() for g in (_local(p.grad) for p in params)]
    moment_lists = ([state[k] for state in states] for k in _FP8_STATE)
    torch.ops.fp8ops.adamw_step_multi(targets, grads, *moment_lists, scalars, rng)
    _write_back(params, targets)


def _step_float32(params: list, states: list, scalars: torch.Tensor, rng: torch.Tensor) -> None:
    """Parameters with float32 moments (small ones: biases, norm gains), one at a time."""
    targets = _contiguous_targets(params)
    for target, p, state, row, words in zip(targets, params, states, scalars.tolist(),
                                            rng.tolist()):
        adamw.step_float32(target, _local(p.grad), state["m"], state["v"], *row, *words)
    _write_back(params, targets)


def _check_hyper(lr, betas, eps, weight_decay, second_moment, min_fp8_numel) -> None:
    if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
        raise ValueError(f"FP8AdamW: lr must be a float >= 0, got {lr!r}")
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"FP8AdamW: betas must be two floats in [0, 1), got {betas!r}")
    if not 0.0 <= eps:
        raise ValueError(f"FP8AdamW: eps must be >= 0, got {eps!r}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"FP8AdamW: weight_decay must be >= 0, got {weight_decay!r}")
    if second_moment not in moments.SECOND_MOMENTS:
        raise ValueError(f"FP8AdamW: second_moment must be one of {moments.SECOND_MOMENTS}, "
                         f"got {second_moment!r}")
    if int(min_fp8_numel) != min_fp8_numel or min_fp8_numel < 0:
        raise ValueError(f"FP8AdamW: min_fp8_numel must be an int >= 0, got {min_fp8_numel!r}")


class FP8AdamW(Optimizer):
    """AdamW with its moments in FP8 (block scales of 128 values) and the master in the
    parameter's own dtype (float32, or bfloat16 updated with stochastic rounding).

    lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
    second_moment: how v is stored: "sqrt_e4m3" (default), "e5m2" or "bf16" (moments.py).
    min_fp8_numel: parameters with fewer values keep float32 moments (default 4096).
    seed: the stochastic rounding stream of bf16 parameters (each parameter and step reads its
      own part of it: runs with the same seed give the same bytes).
    skip_nonfinite: step() leaves everything unchanged when a gradient holds inf or NaN
      (`last_step_skipped`, `skipped_steps` say so); the norm of clip_grad_norm_ since the last
      step is reused, else one pass computes it.

    state_dict() is exact (FP8 bytes and scales); load_state_dict() also takes the state of a
    torch Adam/AdamW (its moments rounded into this format) and to_torch_state_dict() gives one
    (the moments as float32), see docs/numerics.md.
    """

    decoupled_weight_decay = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, second_moment: str = "sqrt_e4m3",
                 min_fp8_numel: int = 4096, seed: int = 0, skip_nonfinite: bool = False):
        _check_hyper(lr, tuple(betas), eps, weight_decay, second_moment, min_fp8_numel)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        second_moment=second_moment, min_fp8_numel=int(min_fp8_numel),
                        seed=int(seed))
        super().__init__(params, defaults)
        self.skip_nonfinite = skip_nonfinite
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._total_norm: Optional[torch.Tensor] = None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # (fills in the defaults the checks read)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()  # a refused group is not kept: no step ever sees it
            raise

    def _check_group(self, group: dict) -> None:
        _check_hyper(group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"],
                     group["second_moment"], group["min_fp8_numel"])
        for p in group["params"]:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"{type(self).__name__}: parameters must be float32 or bfloat16 "
                                f"(bfloat16 ones are updated with stochastic rounding), got one "
                                f"of dtype {p.dtype} and shape {tuple(p.shape)}")

    # -- the step ----------------------------------------------------------------------------
    def _params_with_grad(self):
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse "
                                           "gradients")
                    yield group, index, p
                index += 1

    def _grads_finite(self) -> bool:
        if self._total_norm is not None:
            return bool(torch.isfinite(self._total_norm))
        grads = [p.grad for _, _, p in self._params_with_grad()]
        if not grads:
            return True
        # DTensor gradients (FSDP2) give the norm over all ranks: every rank decides alike
        return bool(torch.isfinite(_full(torch.nn.utils.get_total_norm(grads, 2.0))))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's gradients; the norm is kept for
        the next step's skip_nonfinite check."""
        params = [p for _, _, p in self._params_with_grad()]
        self._total_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                                error_if_nonfinite, foreach))
        return self._total_norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_skipped = self.skip_nonfinite and not self._grads_finite()
        self._total_norm = None
        if self.last_step_skipped:
            self.skipped_steps += 1
            return loss
        for group, members in self._groups_with_grad():
            self._step_group(group, members)
        return loss

    def _groups_with_grad(self):
        """Each param group with its parameters that have gradients, as (index, p) pairs."""
        members = {}
        for group, index, p in self._params_with_grad():
            members.setdefault(id(group), (group, []))[1].append((index, p))
        return members.values()

    def _init_state(self, group: dict, p: torch.Tensor) -> dict:
        local = _local(p)
        fp8 = local.numel() >= group["min_fp8_numel"]
        state = moments.empty_state(local.numel(), group["second_moment"], fp8, local.device)
        state["step"] = torch.tensor(0.0)
        return state

    def _step_group(self, group: dict, members: list) -> None:
        """One step of a param group's parameters: their step counts advanced together, then
        one op call per bucket of parameters the op can take at once."""
        states = []
        for _, p in members:
            state = self.state[p]
            if not state:
                state.update(self._init_state(group, p))
            states.append(state)
        step_counts = [s["step"] for s in states]
        torch._foreach_add_(step_counts, 1.0)
        steps = torch.stack(step_counts).to(torch.int64)
        indices = torch.tensor([index for index, _ in members], dtype=torch.int64)
        scalars, rng = adamw.scalar_table(group["lr"], group["betas"], group["eps"],
                                          group["weight_decay"], self.decoupled_weight_decay,
                                          steps, group["seed"], indices)
        for rows in _buckets(members, states).values():
            params = [members[i][1] for i in rows]
            bucket_states = [states[i] for i in rows]
            take = torch.tensor(rows, dtype=torch.int64)
            step = _step_float32 if moments.form(bucket_states[0]) == "float32" else _step_fp8
            step(params, bucket_states, scalars[take], rng[take])

    # -- checkpoints -------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """This optimizer's state_dict (exact), or a torch Adam/AdamW one: its moments rounded
        into this optimizer's format, its lr, betas, eps and weight_decay taken."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{type(self).__name__}.load_state_dict: {len(saved_groups)} param "
                             f"groups saved, {len(self.param_groups)} here")
        groups = []
        for saved, group in zip(saved_groups, self.param_groups):
            if saved.get("amsgrad") or saved.get("maximize"):
                raise ValueError(f"{type(self).__name__}.load_state_dict: the saved optimizer "
                                 "used amsgrad or maximize, which this one does not implement")
            merged = {k: v for k, v in group.items() if k != "params"}
            merged.update({k: saved[k] for k in merged if k in saved})
            merged["betas"] = tuple(merged["betas"])
            merged["params"] = saved["params"]
            groups.append(merged)
        saved_state = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": groups})
        for saved, group in zip(groups, self.param_groups):
            for saved_id, p in zip(saved["params"], group["params"]):
                if saved_id in saved_state:
                    self.state[p] = self._loaded(group, p, saved_state[saved_id])

    def _loaded(self, group: dict, p: torch.Tensor, saved: dict) -> dict:
        local = _local(p)
        state = self._init_state(group, p)
        state["step"] = torch.tensor(float(saved["step"]))
        if all(k in saved for k in _TORCH_STATE):
            m, v = (_local(saved[k]).reshape(-1).float().to(local.device) for k in _TORCH_STATE)
            if m.numel() != local.numel() or v.numel() != local.numel():
                raise ValueError(f"{type(self).__name__}.load_state_dict: saved moments of "
                                 f"{m.numel()} values for a parameter of {local.numel()}")
            moments.write(state, m, v)
            return state
        same = {k: t.to(local.device) for k, t in saved.items() if k != "step"}
        if moments.form(same) == moments.form(state) and all(
                same[k].shape == state[k].shape for k in same if k in state):
            state.update(same)  # the exact bytes
            return state
        m, v = moments.read(same, local.numel())
        moments.write(state, m, v)
        return state

    def to_torch_state_dict(self) -> dict:
        """This optimizer's state in torch.optim.AdamW's format (Adam's for FP8Adam): the
        moments as float32 tensors of each parameter's (local) shape."""
        ours = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(params):
            if p in self.state and self.state[p]:
                local = _local(p)
                m, v = moments.read(self.state[p], local.numel())
                state[i] = {"step": self.state[p]["step"].clone(),
                            "exp_avg": m.clone().view(local.shape),
                            "exp_avg_sq": v.clone().view(local.shape)}
        groups = []
        for g in ours["param_groups"]:
            groups.append(dict(lr=g["lr"], betas=g["betas"], eps=g["eps"],
                               weight_decay=g["weight_decay"], amsgrad=False, maximize=False,
                               foreach=None, capturable=False, differentiable=False, fused=None,
                               decoupled_weight_decay=self.decoupled_weight_decay,
                               params=g["params"]))
        return {"state": state, "param_groups": groups}

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (moments and scales)."""
        return sum(moments.state_bytes(s) for s in self.state.values())


class FP8Adam(FP8AdamW):
    """Adam (weight decay added to the gradient, L2) with FP8AdamW's state format."""

    decoupled_weight_decay = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
