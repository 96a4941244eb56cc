"""fp8ops.integrations.torchtitan: torchtitan's own Trainer trains its debug models with
FP8Converter on 2 gloo ranks (FSDP2 over the two), on the CPU.

torchtitan targets accelerators; the test runs it unmodified through a small shim
(titan_shim.py: the device type "cpu", FSDP2's reductions as SUM, SDPA attention), applied in
the spawned ranks only, never to torchtitan's files. No tokenizer or dataset ships with the
torchtitan wheel: a tokenizer stub and a synthetic dataloader (each row a stretch of a fixed
cycle through CYCLE of the vocabulary's tokens, from a random start; stateful, so DCP
checkpoints it) stand in. A short cycle is learnt within the 10 steps, so the loss falls well
beyond its step-to-step noise. The torchrun command itself (torchtitan.train's main) runs once,
on a tokenizer and a dataset written for it (titan_cli_main.py).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torchtitan  # noqa: F401  (the test command installs it: a missing one fails, not skips)

from dist_spawn import spawn
from titan_shim import cpu_shim, force_sum_reductions, layer_summary, record_losses, sdpa

STEPS = 10
SEQ_LEN = 64
BATCH = 2
RECIPES = ("delayed", "current", "mxfp8", "blockwise")
CYCLE = 64  # tokens of the synthetic data's cycle


def _data_classes():
    """The tokenizer stub and the synthetic dataloader (torchtitan Configurables)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class StubTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config, **kwargs):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs):
            raise NotImplementedError("synthetic data: nothing to encode")

        def decode(self, *args, **kwargs):
            raise NotImplementedError("synthetic data: nothing to decode")

        def get_vocab_size(self):
            return self.vocab_size

    class CycleDataLoader(BaseDataLoader):
        """Rows of a fixed cycle through CYCLE tokens of the vocabulary, each from a random
        start: a next token the model can learn. Batch i of rank r is the same in every run."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len,
                      local_batch_size, **kwargs):
            self.vocab, self.rank, self.world = config.vocab_size, dp_rank, dp_world_size
            self.seq_len, self.batch = seq_len, local_batch_size
            self.cycle = torch.randperm(self.vocab, generator=torch.Generator().manual_seed(7))
            self.cycle = self.cycle[:CYCLE]
            self.index = 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(1000 * self.index + self.rank)
                starts = torch.randint(0, CYCLE, (self.batch, 1), generator=g)
                rows = self.cycle[(starts + torch.arange(self.seq_len + 1)) % CYCLE]
                self.index += 1
                yield {"input": rows[:, :-1]}, rows[:, 1:]

        def state_dict(self):
            return {"index": self.index}

        def load_state_dict(self, state_dict):
            self.index = state_dict["index"]

    return StubTokenizer, CycleDataLoader


# ---- the runs (in the spawned ranks) ---------------------------------------------------------

def _trainer_config(base, model_registry, converters, out_dir, *, checkpoint_interval=0,
                    load_step=-1, n_layers=None):
    """torchtitan's config function `base`, with the shim's attention and data, FSDP2 over the
    2 ranks, STEPS steps of BATCH rows of SEQ_LEN tokens, the converters applied."""
    from torchtitan.components.checkpoint import CheckpointManager

    tokenizer, dataloader = _data_classes()
    config = base()
    config.model_spec = model_registry("debugmodel", converters=converters)
    sdpa(config.model_spec.model)
    if n_layers is not None:
        config.model_spec.model.layers = config.model_spec.model.layers[:n_layers]
    config.tokenizer = tokenizer.Config()
    config.dataloader = dataloader.Config()
    config.dump_folder = out_dir
    config.training.seq_len, config.training.local_batch_size = SEQ_LEN, BATCH
    config.training.steps = STEPS
    config.parallelism.data_parallel_shard_degree = 2
    config.debug.seed = 42  # the same initial weights in every run
    config.validator.enable = False
    config.metrics.log_freq = 1
    config.checkpoint = CheckpointManager.Config(
        enable=checkpoint_interval > 0, folder="checkpoint", interval=checkpoint_interval or 500,
        last_save_model_only=False, load_step=load_step)
    return config


def _train(config) -> dict:
    """Train; the loss of every step (torchtitan's logged global average) and the model."""
    from torchtitan.trainer import Trainer

    trainer = Trainer(config)
    force_sum_reductions(trainer.model_parts[0])  # (gloo has no PREMUL_SUM: titan_shim.py)
    losses = record_losses(trainer)
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"losses": losses, "model": trainer.model_parts[0]}


def _llama_run(recipe, dump_folder, checkpoint_interval, load_step, rank, out_dir,
               compiled=False, tensor_parallel=False, checkpointing=True, fsdp_ranks=1):
    """Train the llama3 debug model, converted with `recipe` (None: unconverted); `compiled`: with
    torchtitan's torch.compile of each block; `tensor_parallel`: torchtitan's tensor parallelism
    over 2 ranks, with FSDP2 over `fsdp_ranks` (1: none; the ranks are 2 * fsdp_ranks), and
    torchtitan's selective activation checkpointing, as every run here, unless not
    `checkpointing`. One process group per run: a second Trainer in the same processes trips
    over the first one's meshes."""
    cpu_shim()
    from torchtitan.models.llama3 import config_registry, model_registry

    from fp8ops.integrations.torchtitan import FP8Converter

    converters = None if recipe is None else [
        FP8Converter.Config(recipe=recipe, model_compile_enabled=compiled)]
    config = _trainer_config(config_registry.llama3_debugmodel, model_registry, converters,
                             dump_folder, checkpoint_interval=checkpoint_interval,
                             load_step=load_step)
    config.compile.enable, config.compile.components = compiled, ["model"]
    if tensor_parallel:
        config.parallelism.data_parallel_shard_degree = fsdp_ranks
        config.parallelism.tensor_parallel_degree = 2
    if not checkpointing:
        config.activation_checkpoint = None
    trained = _train(config)
    summary = {"losses": trained["losses"], **layer_summary(trained["model"])}
    if tensor_parallel:
        summary.update(_tensor_parallel_scales(trained["model"]))
    return summary


def _tensor_parallel_scales(model) -> dict:
    """Per FP8 layer: the roles whose amaxes it all-reduces over the "tp" mesh, and the scale
    of its last weight cast (of this rank's shard)."""
    from fp8ops.integrations.torchtitan import FP8TitanLinear

    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8TitanLinear)}
    return {"sharded_roles": {n: sorted(m.fp8_state.shard_meshes) for n, m in layers.items()},
            "weight_scales": {n: m.fp8_state.weight_cache.entry.scale.clone()
                              for n, m in layers.items()}}


def _moe_run(converted, fp8_all_gather, rank, out_dir):
    """Train the deepseek_v3 debug model (MoE), converted with current scaling or not."""
    cpu_shim()
    from torchtitan.models.deepseek_v3 import config_registry, model_registry

    from fp8ops.integrations.torchtitan import FP8Converter

    converters = [FP8Converter.Config(recipe="current", fp8_all_gather=fp8_all_gather)]
    config = _trainer_config(config_registry.deepseek_v3_debugmodel, model_registry,
                             converters if converted else None, out_dir)
    trained = _train(config)
    return {"losses": trained["losses"], **layer_summary(trained["model"]),
            "experts_gathered": _experts_gathered(trained["model"])}


def _experts_gathered(model) -> list:
    """Per FP8 experts parameter: whether FSDP2 gathers it in FP8 (its shard's local tensor
    is fp8ops' FP8WeightShard)."""
    from torch.distributed.tensor import DTensor

    from fp8ops.distributed.fsdp import FP8WeightShard
    from fp8ops.integrations.torchtitan import FP8GroupedExperts

    return [isinstance(p, DTensor) and isinstance(p._local_tensor, FP8WeightShard)
            for m in model.modules() if isinstance(m, FP8GroupedExperts)
            for p in (m.w1_EFD, m.w2_EDF, m.w3_EFD)]


def _spawn_run(worker) -> dict:
    """Rank 0's result; the ranks log the same global losses."""
    results = spawn(worker)
    assert results[0]["losses"] == results[1]["losses"]
    return results[0]


# ---- the assertions --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """The unconverted run, a run per recipe (delayed scaling's checkpointed at step 5) and the
    delayed-scaling run resumed from that checkpoint."""
    root = tmp_path_factory.mktemp("torchtitan")
    runs = {"baseline": _spawn_run(partial(_llama_run, None, str(root / "baseline"), 0, -1))}
    for recipe in RECIPES:
        interval = 5 if recipe == "delayed" else 0
        runs[recipe] = _spawn_run(partial(_llama_run, recipe, str(root / recipe), interval, -1))
    runs["resumed"] = _spawn_run(partial(_llama_run, "delayed", str(root / "delayed"), 5, 5))
    return runs


def _block_linears(summary) -> dict:
    return {n: kind for n, kind in summary["linears"].items() if n.startswith("layers.")}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_llama3_within_3_percent(llama_runs, recipe):
    base, fp8 = llama_runs["baseline"]["losses"], llama_runs[recipe]
    assert sorted(fp8["losses"]) == list(range(1, STEPS + 1))
    blocks = _block_linears(fp8)
    assert blocks and set(blocks.values()) == {"fp8"}, blocks
    assert fp8["linears"]["lm_head"] == "high precision"  # filter_fqns' default
    assert fp8["high_precision_calls"] == 0  # every call of every FP8 layer ran FP8
    # torchtitan's FSDP2 gathers the weights in FP8 by itself (MXFP8: in high precision)
    assert fp8["fp8_gathered"] == (0 if recipe == "mxfp8" else fp8["fp8_layers"])
    first, last = base[1], base[STEPS]
    assert last < 0.5 * first, base  # the baseline learns: the comparison means something
    assert abs(fp8["losses"][STEPS] - last) <= 0.03 * last, (fp8["losses"], base)
    assert fp8["losses"] != base  # FP8 GEMMs ran: not the high-precision run's bytes


def test_compiled_model_trains_within_3_percent(llama_runs, tmp_path):
    """model_compile_enabled: torchtitan compiles each block (fullgraph, selective activation
    checkpointing inside); the FP8 layers are traced, their weights gathered in high precision."""
    base = llama_runs["baseline"]["losses"]
    fp8 = _spawn_run(partial(_llama_run, "current", str(tmp_path), 0, -1, compiled=True))
    assert set(_block_linears(fp8).values()) == {"fp8"}
    assert fp8["high_precision_calls"] == 0 and fp8["fp8_gathered"] == 0
    assert abs(fp8["losses"][STEPS] - base[STEPS]) <= 0.03 * base[STEPS], (fp8["losses"], base)


def test_tensor_parallel_trains_within_3_percent(llama_runs, tmp_path):
    """torchtitan's tensor parallelism (its sharding configs, carried over by the converter)
    over the 2 ranks, with its selective activation checkpointing (as without it, bit for bit):
    every FP8 weight sharded over "tp", every call FP8, and the per-tensor scales those of the
    whole tensors: the sharded roles' amaxes all-reduced over "tp" (colwise layers: weight and
    output gradient; rowwise, wo and w2: weight and input), so both ranks cast their weight
    shards with one scale."""
    base = llama_runs["baseline"]["losses"]
    results = spawn(partial(_llama_run, "current", str(tmp_path), 0, -1, tensor_parallel=True))
    assert results[0]["losses"] == results[1]["losses"]
    fp8 = results[0]
    assert set(_block_linears(fp8).values()) == {"fp8"}
    assert fp8["tp_sharded"] == fp8["fp8_layers"] > 0
    assert fp8["high_precision_calls"] == 0
    roles = fp8["sharded_roles"]
    assert len(roles) == fp8["fp8_layers"]
    for name, sharded in roles.items():
        rowwise = name.endswith((".wo", ".w2"))
        assert sharded == (["input", "weight"] if rowwise else ["grad", "weight"]), name
        assert torch.equal(results[0]["weight_scales"][name], results[1]["weight_scales"][name])
    assert abs(fp8["losses"][STEPS] - base[STEPS]) <= 0.03 * base[STEPS], (fp8["losses"], base)
    # the checkpointed blocks' recompute reuses each forward's casts: the run without
    # activation checkpointing gives the same losses, bit for bit
    plain = _spawn_run(partial(_llama_run, "current", str(tmp_path / "plain"), 0, -1,
                               tensor_parallel=True, checkpointing=False))
    assert plain["losses"] == fp8["losses"]


def test_fsdp2_and_tensor_parallel_together(tmp_path):
    """FSDP2 over 2 ranks times tensor parallelism over 2 (4 ranks, current scaling): it trains,
    every FP8 weight sharded over "tp" with the scales of the whole weights; FSDP2 gathers the
    weights in high precision (fp8ops' FP8 all-gather takes a 1-D mesh; the weights live on the
    2-D one)."""
    results = spawn(partial(_llama_run, "current", str(tmp_path), 0, -1, tensor_parallel=True,
                            fsdp_ranks=2), world=4)
    fp8 = results[0]
    assert all(r["losses"] == fp8["losses"] for r in results)
    assert set(_block_linears(fp8).values()) == {"fp8"}
    assert fp8["tp_sharded"] == fp8["fp8_layers"] > 0 and fp8["fp8_gathered"] == 0
    assert fp8["high_precision_calls"] == 0
    for name, sharded in fp8["sharded_roles"].items():
        assert "weight" in sharded, name
        assert all(torch.equal(r["weight_scales"][name], fp8["weight_scales"][name])
                   for r in results)
    losses = fp8["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < 0.5 * losses[1], losses


def test_dcp_resume_is_bit_exact(llama_runs):
    resumed, straight = llama_runs["resumed"]["losses"], llama_runs["delayed"]["losses"]
    assert sorted(resumed) == list(range(6, STEPS + 1))
    assert resumed == {step: straight[step] for step in resumed}


def _hf_checkpoint_run(load, folder, rank, out_dir):
    """5 steps of the llama3 debug model (delayed scaling), saving its last step in Hugging Face
    format (torchtitan's state-dict adapter), or, with `load`, starting from that checkpoint."""
    cpu_shim()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3 import config_registry, model_registry

    from fp8ops.integrations.torchtitan import FP8Converter

    config = _trainer_config(config_registry.llama3_debugmodel, model_registry,
                             [FP8Converter.Config(recipe="delayed")], folder)
    config.training.steps = 5
    if load:
        config.checkpoint = CheckpointManager.Config(
            enable=True, folder="loaded", initial_load_in_hf=True,
            initial_load_path=os.path.join(folder, "checkpoint", "step-5"))
    else:
        config.checkpoint = CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=500, last_save_model_only=True,
            last_save_in_hf=True, export_dtype="float32")
    return {"losses": _train(config)["losses"]}


def test_hugging_face_checkpoint_round_trip(tmp_path):
    """torchtitan's HF conversion applies to the converted model: the saved checkpoint holds
    the Llama names and nothing of the FP8 state, and a run loads it (its FP8 state fresh) and
    starts from the trained weights."""
    from safetensors import safe_open

    saved = _spawn_run(partial(_hf_checkpoint_run, False, str(tmp_path)))
    step = tmp_path / "checkpoint" / "step-5"
    keys = set()
    for path in step.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys.update(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "lm_head.weight" in keys
    assert not [k for k in keys if "fp8" in k]
    loaded = _spawn_run(partial(_hf_checkpoint_run, True, str(tmp_path)))
    assert loaded["losses"][1] < 0.8 * saved["losses"][1], (loaded, saved)


def test_moe_trains_with_fp8_experts():
    """The deepseek_v3 debug model: FP8 experts (their parameters gathered in FP8 by FSDP2, bit
    for bit the run that gathers them in high precision), the router gates in high precision,
    the last loss within 5% of the unconverted run's (measured: +2.9%; the routing moves with
    every rounding of the scores, so MoE runs part further than the dense ones)."""
    fp8 = _spawn_run(partial(_moe_run, True, True))
    high = _spawn_run(partial(_moe_run, True, False))
    base = _spawn_run(partial(_moe_run, False, False))["losses"]
    assert fp8["fp8_experts"] > 0
    assert fp8["experts_gathered"] and all(fp8["experts_gathered"])
    assert high["experts_gathered"] and not any(high["experts_gathered"])
    assert fp8["losses"] == high["losses"]  # the same casts, fewer bytes on the wire
    assert "fp8" in _block_linears(fp8).values()
    gates = {n: kind for n, kind in fp8["linears"].items() if n.endswith("router.gate")}
    assert gates and set(gates.values()) == {"high precision"}, gates
    assert fp8["linears"]["lm_head"] == "high precision"
    assert sorted(fp8["losses"]) == list(range(1, STEPS + 1))
    assert base[STEPS] < 0.5 * base[1], base  # the baseline learns
    gap = fp8["losses"][STEPS] / base[STEPS] - 1
    print(f"MoE last loss: FP8 experts {fp8['losses'][STEPS]:.3f}, unconverted "
          f"{base[STEPS]:.3f} ({gap:+.1%})")  # (the figure docs/torchtitan.md quotes)
    assert abs(gap) <= 0.05, (fp8["losses"], base)
    assert fp8["losses"] != base


def _write_assets(root) -> None:
    """What torchtitan's debug configs read, under root: tests/assets/tokenizer (a word-level
    tokenizer over CYCLE words and the special tokens) and tests/assets/c4_test (rows of text,
    each a stretch of the cycle through those words)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(CYCLE)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tests/assets/tokenizer").mkdir(parents=True)
    tokenizer.save(str(root / "tests/assets/tokenizer/tokenizer.json"))
    special = {str(i): {"content": t, "special": True} for t, i in vocab.items() if i < 3}
    (root / "tests/assets/tokenizer/tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "added_tokens_decoder": special}))
    (root / "tests/assets/c4_test").mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    starts = torch.randint(0, CYCLE, (256,), generator=g).tolist()
    rows = [" ".join(words[(s + i) % CYCLE] for i in range(200)) for s in starts]
    (root / "tests/assets/c4_test/c4.json").write_text(
        "".join(json.dumps({"text": row}) + "\n" for row in rows))


def test_torchrun_command_trains(tmp_path):
    """The command of docs/torchtitan.md, `torchrun --nproc_per_node=2 -m torchtitan.train
    --module fp8ops.integrations.torchtitan --config llama3_debugmodel_fp8` with command-line
    overrides, run through torchtitan.train's own main() (titan_cli_main.py: the CPU shim, then
    main) on a tokenizer and a dataset written for it: it trains, every block Linear FP8."""
    import json
    import subprocess

    _write_assets(tmp_path)
    out = tmp_path / "result"
    out.mkdir()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "titan_cli_main.py")
    steps = 8
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", script,
               "--module", "fp8ops.integrations.torchtitan", "--config", "llama3_debugmodel_fp8",
               "--training.steps", str(steps), "--training.local_batch_size", "2",
               "--training.seq_len", "64", "--dump_folder", str(tmp_path / "dump"),
               "--debug.seed", "42"]  # (the same initial weights in every run)
    env = {**os.environ, "FP8OPS_TITAN_OUT": str(out), "OMP_NUM_THREADS": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    losses = {int(k): v for k, v in ranks[0]["losses"].items()}
    assert sorted(losses) == list(range(1, steps + 1))
    assert all(math.isfinite(v) for v in losses.values())
    print(f"torchrun command, loss at step 1: {losses[1]:.2f}, at step {steps}: "
          f"{losses[steps]:.2f}")  # (the figures docs/torchtitan.md quotes)
    assert losses[steps] < 0.7 * losses[1], losses  # it learns the cycle
    blocks = {n: kind for n, kind in ranks[0]["linears"].items() if n.startswith("layers.")}
    assert blocks and set(blocks.values()) == {"fp8"}, blocks
    assert ranks[0]["linears"]["lm_head"] == "high precision"
    assert ranks[0]["high_precision_calls"] == 0


def test_import_fp8ops_does_not_import_torchtitan():
    import subprocess

    code = "import sys, fp8ops; sys.exit('torchtitan' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


@pytest.mark.parametrize("function", ["llama3_debugmodel_fp8", "deepseek_v3_debugmodel_fp8"])
def test_config_functions_load_through_torchtitans_cli(function):
    """What `torchtitan.train --module fp8ops.integrations.torchtitan --config <function>`
    parses: the debug model's config tree, converted."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    from fp8ops.integrations.torchtitan import FP8GroupedExperts, FP8TitanLinear

    config = ConfigManager().parse_args(
        ["--module", "fp8ops.integrations.torchtitan", "--config", function,
         "--training.steps", "3"])
    assert config.training.steps == 3  # torchtitan's CLI overrides still apply
    model = config.model_spec.model
    kinds = {fqn: type(cfg) for fqn, cfg, _, _ in model.traverse(Linear.Config)}
    assert kinds["lm_head"] is Linear.Config
    assert any(kind is FP8TitanLinear.Config for kind in kinds.values())
    assert all(kind is FP8TitanLinear.Config for fqn, kind in kinds.items()
               if fqn.startswith("layers.") and not fqn.endswith("router.gate"))
    experts = [type(cfg) for _, cfg, _, _ in model.traverse(GroupedExperts.Config)]
    assert all(kind is FP8GroupedExperts.Config for kind in experts)
    assert bool(experts) == function.startswith("deepseek")


def test_converter_refuses_unknown_choices():
    from fp8ops.integrations.torchtitan import FP8Converter

    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        FP8Converter.Config(recipe="fp4").build()
    with pytest.raises(ValueError, match="fallback must be"):
        FP8Converter.Config(fallback="sometimes").build()
