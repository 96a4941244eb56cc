"""FP8Converter: torchtitan's model converter for fp8ops.

torchtitan converters rewrite the model's config tree before the model is built. This one
replaces each plain Linear.Config with an FP8TitanLinear.Config (same fields, param_init and
sharding_config carried over) and each GroupedExperts.Config with an FP8GroupedExperts.Config;
modules whose name contains one of `filter_fqns`, the MoE router's gate (torchtitan's selective
activation checkpointing expects an nn.Linear there) and Linear subclasses with a forward of
their own stay as they are."""
import logging
from dataclasses import dataclass, field, fields
from typing import Literal

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter

from ...nn.fallback import check_fallback
from .experts import FP8GroupedExperts
from .layers import FP8TitanLinear
from .recipes import RECIPES

logger = logging.getLogger("fp8ops.torchtitan")


class FP8Converter(QuantizationConverter):
    """Swap a torchtitan model's Linear layers for fp8ops FP8 layers and its MoE experts for
    FP8 grouped GEMMs (config-tree rewrite; see the module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: Literal["delayed", "current", "mxfp8", "blockwise"] = "current"
        """fp8ops recipe: per-tensor delayed or current scaling, MXFP8, or 128x128 blockwise."""

        fallback: Literal["auto", "never"] = "auto"
        """Where a call runs the high-precision GEMMs instead: "auto" (shapes too small for
        FP8 to pay), "never"."""

        fp8_all_gather: bool = True
        """Under FSDP2, gather the FP8 layers' weights (and the FP8 experts') in FP8 where the
        recipe allows (not when model_compile_enabled: torchtitan compiles each block as one
        graph, which a layer reading an FP8-gathered weight would break)."""

        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
        """Modules left in high precision: those whose name contains one of these."""

    def __init__(self, config: Config):
        if config.recipe not in RECIPES:
            raise ValueError(f"FP8Converter: unknown recipe {config.recipe!r}: expected one of "
                             f"{sorted(RECIPES)}")
        check_fallback(config.fallback)
        self.config = config

    def convert(self, model_config):
        cfg = self.config
        # torchtitan compiles each block with fullgraph=True, and a layer reading an FP8-gathered
        # weight breaks the graph (it runs eagerly under torch.compile): gather in high precision
        gather = cfg.fp8_all_gather and not cfg.model_compile_enabled
        if cfg.fp8_all_gather and not gather:
            logger.info("fp8ops: the model is compiled (fullgraph): FSDP2 gathers the FP8 "
                        "layers' weights in high precision")
        linears = experts = 0
        for fqn, linear, parent, attr in list(model_config.traverse(Linear.Config)):
            if (type(linear) is not Linear.Config or parent is None
                    or any(name in fqn for name in cfg.filter_fqns)
                    or isinstance(parent, TokenChoiceTopKRouter.Config)):
                continue
            _replace(parent, attr, FP8TitanLinear.Config(
                in_features=linear.in_features, out_features=linear.out_features,
                bias=linear.bias, param_init=linear.param_init,
                sharding_config=linear.sharding_config, recipe=cfg.recipe,
                fp8_all_gather=gather, fallback=cfg.fallback))
            linears += 1
        for fqn, grouped, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            if (type(grouped) is not GroupedExperts.Config or parent is None
                    or any(name in fqn for name in cfg.filter_fqns)):
                continue
            values = {f.name: getattr(grouped, f.name) for f in fields(grouped)}
            _replace(parent, attr, FP8GroupedExperts.Config(**values, recipe=cfg.recipe,
                                                            fp8_all_gather=gather))
            experts += 1
        logger.info("fp8ops: %d Linear layers and %d expert groups converted to FP8 (recipe "
                    "%s)", linears, experts, cfg.recipe)
        return model_config


def _replace(parent, attr, config) -> None:
    if isinstance(parent, list):
        parent[attr] = config
    else:
        setattr(parent, attr, config)
