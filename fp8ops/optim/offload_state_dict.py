"""The state_dict of a module whose FP8 weight a CPUOffloadOptimizer owns: the weight is the host
master, in the parameter's dtype (the parameter on the device is a placeholder), and loading a
checkpoint writes the master. Hooks on the module, one set per module, acting on whichever of
its own parameters are offloaded when they run: a copy or an unpickled module, whose parameters
are ordinary, passes through them unchanged. Module-level functions, so that the module still
pickles with them."""
from __future__ import annotations

from torch import nn

from ..nn.caches import caches_by_name, readers_by_weight
from .host_weight import OffloadedWeight

_MARK = "_fp8ops_offload_state_dict"  # in a module's __dict__: its hooks are installed


def install(module: nn.Module) -> None:
    """Give `module` the hooks (once). The state_dict hook goes first, so that the module's
    other state_dict hooks, the user's included, see the weight's values."""
    if module.__dict__.get(_MARK):
        return
    handle = module.register_state_dict_post_hook(_save)
    module._state_dict_hooks.move_to_end(handle.id, last=False)
    module.register_load_state_dict_pre_hook(_load)
    module.register_load_state_dict_post_hook(_loaded)
    module.__dict__[_MARK] = True


def _offloaded(module: nn.Module):
    return [(name, p) for name, p in module._parameters.items() if isinstance(p, OffloadedWeight)]


def _save(module, state_dict, prefix, local_metadata) -> None:
    for name, param in _offloaded(module):
        if prefix + name in state_dict:
            state_dict[prefix + name] = param._host.state_value()


def _load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
          error_msgs) -> None:
    """Load an offloaded weight into its host master and take its key out of the checkpoint, so
    that the module's own loading leaves the placeholder alone (_loaded takes the key out of the
    missing ones). A changed master ends the casts made from the old values, in every layer
    that casts the weight (a weight tied across modules: the others see an unchanged master)."""
    loaded = module.__dict__["_fp8ops_offload_loaded"] = []  # (this load's: none left before)
    for name, param in _offloaded(module):
        key = prefix + name
        if key not in state_dict:
            continue
        value = state_dict.pop(key)
        loaded.append(key)  # (a size mismatch is an error of its own, not a missing key)
        if tuple(value.shape) != tuple(param.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(value.shape)} from checkpoint, the shape in current "
                              f"model is {tuple(param.shape)}.")
        elif param._host.load_(value):
            for mod, weight in readers_by_weight([param]).get(id(param), []):
                caches_by_name(mod)[weight].invalidate()


def _loaded(module, incompatible_keys) -> None:
    loaded = module.__dict__.pop("_fp8ops_offload_loaded", [])
    for key in loaded:
        if key in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(key)
