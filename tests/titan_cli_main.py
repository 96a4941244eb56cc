"""torchtitan.train's main on the CPU, for the torchrun command of docs/torchtitan.md:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/titan_cli_main.py \\
        --module fp8ops.integrations.torchtitan --config llama3_debugmodel_fp8 ...

takes the arguments `-m torchtitan.train` takes and runs its main() unchanged, after the CPU
shim (titan_shim.py), in a directory that holds what torchtitan's debug configs read
(tests/assets/tokenizer, tests/assets/c4_test). The shim's parts that act on the parsed config
and the built trainer wrap ConfigManager.parse_args (SDPA attention) and Trainer.train (FSDP2's
SUM reductions); the latter also writes, per rank, the losses torchtitan logged and the trained
model's layer_summary to $FP8OPS_TITAN_OUT/rank<r>.json (for tests/test_torchtitan.py)."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titan_shim import (cpu_shim, force_sum_reductions, layer_summary,  # noqa: E402
                        record_losses, sdpa)


def main() -> None:
    cpu_shim()
    from torchtitan import train
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    parse_args = ConfigManager.parse_args

    def parse_args_on_cpu(self, args=None):
        config = parse_args(self, args)
        sdpa(config.model_spec.model)
        return config

    run = Trainer.train

    def train_and_record(self):
        force_sum_reductions(self.model_parts[0])
        losses = record_losses(self)
        result = run(self)
        path = os.path.join(os.environ["FP8OPS_TITAN_OUT"], f"rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump({"losses": losses, **layer_summary(self.model_parts[0])}, f)
        return result

    ConfigManager.parse_args = parse_args_on_cpu
    Trainer.train = train_and_record
    train.main()


if __name__ == "__main__":
    main()
