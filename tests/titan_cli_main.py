"""torchtitan.train's main on the CPU, for the torchrun command of docs/torchtitan.md:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/titan_cli_main.py \\
        --module fp8ops.integrations.torchtitan --config llama3_debugmodel_fp8 ...

takes the arguments `-m torchtitan.train` takes and runs its main() unchanged, after the CPU
shim (titan_shim.py), in a directory that holds what torchtitan's debug configs read
(tests/assets/tokenizer, tests/assets/c4_test). The shim's parts that act on the parsed config
and the built trainer wrap ConfigManager.parse_args (SDPA attention) and Trainer.train (FSDP2's
SUM reductions); the latter also writes, per rank, the losses torchtitan logged, which Linear
layers were FP8 and how many of their calls ran in high precision to
$FP8OPS_TITAN_OUT/rank<r>.json (for tests/test_torchtitan.py)."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titan_shim import cpu_shim, force_sum_reductions, sdpa  # noqa: E402


def main() -> None:
    cpu_shim()
    from torchtitan import train
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    from fp8ops.integrations.torchtitan import FP8TitanLinear

    parse_args = ConfigManager.parse_args

    def parse_args_on_cpu(self, args=None):
        config = parse_args(self, args)
        sdpa(config.model_spec.model)
        return config

    run = Trainer.train

    def train_and_record(self):
        force_sum_reductions(self.model_parts[0])
        losses, log = {}, self.metrics_processor.log

        def record(step, loss, *args, **kwargs):
            losses[step] = float(loss)
            return log(step, loss, *args, **kwargs)

        self.metrics_processor.log = record
        result = run(self)
        linears = {n: isinstance(m, FP8TitanLinear)
                   for n, m in self.model_parts[0].named_modules()
                   if isinstance(m, torch.nn.Linear)}
        high = sum(m.fp8_state.high_precision_calls for m in self.model_parts[0].modules()
                   if isinstance(m, FP8TitanLinear))
        path = os.path.join(os.environ["FP8OPS_TITAN_OUT"], f"rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump({"losses": losses, "fp8": linears, "high_precision_calls": high}, f)
        return result

    ConfigManager.parse_args = parse_args_on_cpu
    Trainer.train = train_and_record
    train.main()


if __name__ == "__main__":
    main()
