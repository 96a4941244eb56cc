"""What torchtitan needs to train on the CPU with gloo, applied in a test's own processes and
never to torchtitan's files (tests/test_torchtitan.py; tests/titan_cli_main.py for torchrun):
  - cpu_shim: torchtitan picks its device type and module once at import (CUDA when none is
    found); every torchtitan module that took them is pointed at "cpu" and a stub device module
    (no memory statistics, one device), and the local device at the CPU;
  - force_sum_reductions: torchtitan's FSDP2 divides gradients by a factor of 1, which FSDP2 runs
    as a PREMUL_SUM reduce-scatter, one gloo has not: FSDP2 reduces with SUM instead (the same
    sums: the factor is 1);
  - sdpa: flex attention needs torch.compile on the CPU; a model config gets torchtitan's
    ScaledDotProductAttention (causal) in its place.
And what a run reports to the test: record_losses (the losses torchtitan logs) and layer_summary
(which layers of the trained model are what).
"""
from __future__ import annotations

import sys
import types

import torch


class _CPUDevice(types.SimpleNamespace):
    """What torchtitan asks of its device module, for the CPU (no memory statistics)."""

    @staticmethod
    def set_device(device):
        pass

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(total_memory=1 << 34, name="cpu")

    @staticmethod
    def reset_peak_memory_stats(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def synchronize(device=None):
        pass


def cpu_shim() -> None:
    """Point torchtitan's device type and module at the CPU (module doc)."""
    import torchtitan.trainer  # noqa: F401  (imports the modules that hold the device)
    from torchtitan.tools import utils

    device = _CPUDevice()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = device
        if getattr(module, "get_local_device", None) is utils.get_local_device:
            module.get_local_device = lambda: torch.device("cpu")
    utils.get_local_device = lambda: torch.device("cpu")


def force_sum_reductions(model) -> None:
    """FSDP2 reduces model's gradients with SUM (gloo has no PREMUL_SUM; module doc)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def sdpa(model_config):
    """model_config with torchtitan's SDPA in place of its flex attention."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _fqn, _cfg, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return model_config


def record_losses(trainer) -> dict:
    """{step: loss} of the losses the trainer logs (torchtitan's global average), filled as it
    trains."""
    losses, log = {}, trainer.metrics_processor.log

    def record(step, loss, *args, **kwargs):
        losses[step] = float(loss)
        return log(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    return losses


def layer_summary(model) -> dict:
    """Which modules of the trained model are what (for the assertions in pytest)."""
    from torch.distributed.tensor import DTensor

    from fp8ops.distributed.fsdp import FP8WeightShard
    from fp8ops.integrations.torchtitan import FP8GroupedExperts, FP8TitanLinear

    # (FSDP2 renames the classes of the modules it wraps: FSDPLinear)
    linears = {n: "fp8" if isinstance(m, FP8TitanLinear) else "high precision"
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    fp8 = [m for m in model.modules() if isinstance(m, FP8TitanLinear)]
    gathered = [isinstance(m.weight, DTensor) and isinstance(m.weight._local_tensor, FP8WeightShard)
                for m in fp8]
    tp_sharded = [isinstance(m.weight, DTensor) and "tp" in m.weight.device_mesh.mesh_dim_names
                  and m.weight.placements[m.weight.device_mesh.mesh_dim_names.index("tp")]
                  .is_shard() for m in fp8]
    return {"linears": linears, "fp8_layers": len(fp8), "fp8_gathered": sum(gathered),
            "tp_sharded": sum(tp_sharded),
            "high_precision_calls": sum(m.fp8_state.high_precision_calls for m in fp8),
            "fp8_experts": sum(isinstance(m, FP8GroupedExperts) for m in model.modules())}
