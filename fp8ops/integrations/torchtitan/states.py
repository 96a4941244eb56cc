"""The FP8 state modules of fp8ops' layers as torchtitan Modules.

torchtitan's models check that every submodule is a torchtitan Module (verify_module_protocol)
and initialise each through init_states. An FP8 layer's state (ScalingState, with a RoleState
per role under delayed scaling; ExpertScalingState for experts) is a plain nn.Module: these
subclasses add the protocol and nothing else (no parameters; their buffers are refilled by the
owning layer's reset after torchtitan's to_empty). `as_titan_module` turns a state made by fp8ops
into its subclass in place (same attributes, same state_dict)."""
from torchtitan.protocols.module import Module

from ...scaling.expert_state import ExpertRoleState, ExpertScalingState
from ...scaling.role import RoleState
from ...scaling.state import ScalingState


class TitanScalingState(ScalingState, Module):
    """ScalingState satisfying torchtitan's Module protocol."""


class TitanRoleState(RoleState, Module):
    """RoleState satisfying torchtitan's Module protocol."""


class TitanExpertScalingState(ExpertScalingState, Module):
    """ExpertScalingState satisfying torchtitan's Module protocol."""


class TitanExpertRoleState(ExpertRoleState, Module):
    """ExpertRoleState satisfying torchtitan's Module protocol."""


# most derived first: an ExpertRoleState is also a RoleState
_TITAN = ((ExpertScalingState, TitanExpertScalingState), (ExpertRoleState, TitanExpertRoleState),
          (ScalingState, TitanScalingState), (RoleState, TitanRoleState))


def as_titan_module(state):
    """`state` and its submodules, each retyped to its torchtitan Module subclass (in place;
    returns `state`). Refuses a submodule of a kind it does not know."""
    for name, mod in state.named_modules():
        if isinstance(mod, Module):
            continue
        for base, titan in _TITAN:
            if type(mod) is base:
                mod.__class__ = titan
                break
        else:
            raise TypeError(f"fp8ops' torchtitan integration does not know the FP8 state module "
                            f"{type(mod).__name__} ({name or 'the state itself'})")
    return state
