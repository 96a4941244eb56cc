"""The values of an FP8Linear weight kept on the host (FP8 primary weights).

When a CPUOffloadOptimizer owns an FP8Linear weight, the FP32 master copy on the host is the only
high-precision copy of that weight: the parameter on the device becomes a placeholder (one element
broadcast to the weight's shape) and the layer's ScalingState reads the values to cast from here,
once per optimizer step (weight_cache). On a CPU-only machine the device is the host and the cast
reads the master itself.
"""
from __future__ import annotations

import torch


def placeholder(param: torch.Tensor) -> torch.Tensor:
    """What the device keeps of an offloaded weight: one element (NaN, so that anything but an
    FP8Linear reading it shows at once) broadcast to the parameter's shape."""
    return torch.full((), float("nan"), dtype=param.dtype, device=param.device).expand(
        param.shape)


class HostWeight:
    """The FP32 master of one FP8Linear weight and the device and dtype of its parameter."""

    def __init__(self, master: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.master = master
        self.device = torch.device(device)
        self.dtype = dtype

    def device_values(self) -> torch.Tensor:
        """The values to cast to FP8, on the device: the master itself when the device is the
        host, else a transient copy (non-blocking from pinned memory, on the current stream)."""
        if self.master.device == self.device:
            return self.master
        return self.master.to(self.device, non_blocking=True)

    def state_value(self) -> torch.Tensor:
        """The weight as the model's state_dict gives it: the master in the parameter's dtype, on
        the host (the master itself for a float32 parameter)."""
        return self.master.detach().to(self.dtype)

    @torch.no_grad()
    def load_(self, value: torch.Tensor) -> None:
        """Take the weight from a checkpoint. A value equal to the master rounded to the
        parameter's dtype leaves the master as it is, so loading the model after the optimizer
        keeps the optimizer's exact FP32 master."""
        value = value.detach().to("cpu")
        if value.dtype == self.dtype and torch.equal(value, self.master.to(self.dtype)):
            return
        if self.master.is_pinned():  # a copy of the old values may still be in flight
            torch.cuda.synchronize(self.device)
        self.master.copy_(value)
