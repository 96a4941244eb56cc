"""Config functions for `torchtitan.train --module fp8ops.integrations.torchtitan --config
<function>`: torchtitan's debug models with FP8Converter (current scaling; the recipe and the
other converter fields are those of FP8Converter.Config). Each starts from torchtitan's own
config function and only adds the converter, so torchtitan's CLI overrides apply as usual."""
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_configs
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_model
from torchtitan.models.llama3 import config_registry as llama3_configs
from torchtitan.models.llama3 import model_registry as llama3_model
from torchtitan.trainer import Trainer

from .converter import FP8Converter


def fp8_converter(config: Trainer.Config, recipe: str = "current") -> FP8Converter.Config:
    """FP8Converter.Config for `config`'s run (model_compile_enabled as torchtitan sets it)."""
    compiled = config.compile.enable and "model" in config.compile.components
    return FP8Converter.Config(recipe=recipe, model_compile_enabled=compiled)


def llama3_debugmodel_fp8() -> Trainer.Config:
    """torchtitan's llama3 debug model, its Linear layers in FP8 (lm_head left as it is)."""
    config = llama3_configs.llama3_debugmodel()
    config.model_spec = llama3_model("debugmodel", converters=[fp8_converter(config)])
    return config


def deepseek_v3_debugmodel_fp8() -> Trainer.Config:
    """torchtitan's deepseek_v3 debug model (MoE), its Linear layers and its experts in FP8
    (lm_head and the router's gate left as they are)."""
    config = deepseek_v3_configs.deepseek_v3_debugmodel()
    config.model_spec = deepseek_v3_model("debugmodel", converters=[fp8_converter(config)])
    return config
