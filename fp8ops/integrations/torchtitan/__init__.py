"""fp8ops in torchtitan: FP8Converter rewrites a torchtitan model's config tree so that its
Linear layers are fp8ops FP8 layers and its MoE experts run fp8ops' grouped GEMMs; the config
functions of config_registry run torchtitan's debug models with it:

    torchrun --nproc_per_node=2 -m torchtitan.train \\
        --module fp8ops.integrations.torchtitan --config llama3_debugmodel_fp8

See docs/torchtitan.md. Importing this package imports torchtitan (an optional dependency)."""
from .converter import FP8Converter
from .experts import FP8GroupedExperts
from .layers import FP8TitanLinear
from .config_registry import deepseek_v3_debugmodel_fp8, llama3_debugmodel_fp8

__all__ = ["FP8Converter", "FP8TitanLinear", "FP8GroupedExperts", "llama3_debugmodel_fp8",
           "deepseek_v3_debugmodel_fp8"]
