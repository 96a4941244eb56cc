"""The tensors of an exported checkpoint, by the keys transformers loads: the model's plain state
dict (no fp8ops buffers, tied copies once), each converted Linear's weight as its FP8 cast, and
each converted experts module's 3-D parameters split per expert under the names transformers'
checkpoint conversion merges back for that model type."""
from __future__ import annotations

from torch import nn

from ..nn.hf_moe import is_hf_experts
from ..nn.modules import FP8Linear, plain_state_dict
from .weights import FP8Weight, experts_weight, linear_weight, rows

# model type -> (gate name, up name, down name) of one expert in its checkpoints: each expert's
# fused gate_up_proj [2 * inter, hidden] is [gate; up]
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}


def collect(model: nn.Module) -> tuple:
    """(high-precision tensors by key, FP8Weight by weight key, names of the Linear layers left
    in high precision)."""
    fp8: dict = {}
    plain_linears = []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    experts_params = set()
    for name, mod in model.named_modules():
        if isinstance(mod, FP8Linear):
            fp8[f"{name}.weight"] = linear_weight(mod, name)
        elif isinstance(mod, nn.Linear):
            plain_linears.append(name)
        elif is_hf_experts(mod):
            experts_params.update(f"{name}.{p}" for p in ("gate_up_proj", "up_proj",
                                                          "down_proj"))
            if "fp8_recipe" not in mod.__dict__:
                raise NotImplementedError(
                    f"export_fp8: the experts module {name} was left in high precision (its "
                    "recipe has no grouped FP8 layer, e.g. MXFP8Scaling): no FP8 checkpoint "
                    "layout mixes FP8 dense layers with high-precision experts here")
            fp8.update(_experts(mod, name, model_type))
    if not fp8:
        raise ValueError("export_fp8: the model has no FP8 layer: convert it with "
                         "fp8ops.convert_to_fp8 first")
    plain: dict = {}
    seen = set()
    for key, value in plain_state_dict(model).items():
        if key in fp8 or key in experts_params:
            continue
        storage = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
        if storage in seen:  # a tied copy (lm_head tied to the embeddings): saved once
            continue
        seen.add(storage)
        plain[key] = value.detach()
    return plain, fp8, plain_linears


def _experts(mod: nn.Module, name: str, model_type) -> dict:
    if not hasattr(mod, "gate_up_proj"):
        raise NotImplementedError(f"export_fp8: the experts module {name} has no fused "
                                  "gate_up_proj: its checkpoint layout is not written")
    names = _EXPERT_NAMES.get(model_type)
    if names is None:
        raise NotImplementedError(
            f"export_fp8: experts of model type {model_type!r} ({name}): the per-expert "
            f"checkpoint names are known for {sorted(_EXPERT_NAMES)} only")
    gate, up, down = names
    out: dict = {}
    inter = mod.gate_up_proj.shape[1] // 2
    for e, w in enumerate(experts_weight(mod, "gate_up_proj", name)):
        out[f"{name}.{e}.{gate}.weight"] = rows(w, 0, inter, f"{name}.{e}.{gate}")
        out[f"{name}.{e}.{up}.weight"] = rows(w, inter, 2 * inter, f"{name}.{e}.{up}")
    for e, w in enumerate(experts_weight(mod, "down_proj", name)):
        out[f"{name}.{e}.{down}.weight"] = w
    return out


def check_weight_type(fp8: dict) -> str:
    """The one layout of all FP8 weights ("tensor", "block" or "mx")."""
    layouts = {w.layout for w in fp8.values() if isinstance(w, FP8Weight)}
    if len(layouts) != 1:
        raise NotImplementedError(f"export_fp8: layers with different recipes ({sorted(layouts)})"
                                  ": one checkpoint holds one weight layout")
    return layouts.pop()
