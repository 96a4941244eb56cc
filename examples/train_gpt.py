"""Train a small GPT or Llama-style decoder on the Python reference manual, in the baseline
precision and with each fp8ops recipe, and compare: final train / validation loss, gap to the
baseline, tokens/s, memory.

    python examples/train_gpt.py                    # CPU default (emulation backend), a few minutes
    python examples/train_gpt.py --size gpu         # Llama-style, 412M parameters, on one H100/H200
    python examples/train_gpt.py --size gpu-gpt2    # the earlier GPU preset: GPT, d_model 768
    python examples/train_gpt.py --arch llama       # any preset with the other architecture
    python examples/train_gpt.py --offload          # fp8ops.CPUOffloadOptimizer(AdamW) instead
    python examples/train_gpt.py --optimizer fp8adamw   # fp8ops.FP8AdamW: moments in FP8
    python examples/train_gpt.py --optimizer fp8adamw --param-dtype bfloat16 --fp8-activations on
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --fsdp   # sharded, FSDP2
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --fsdp --fp8-reduce-scatter
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --moe --ep 2   # experts split
    python examples/train_gpt.py --moe --recipes baseline,current,blockwise   # mixture of experts
    python examples/train_gpt.py --moe --recipes baseline,current,torchao     # and torchao's recipe

Presets (--size; every field can be overridden by its flag): cpu (the default: GPT d_model 128, 2
layers, batch 16 x seq 64, 200 steps), tiny (GPT d_model 64, 1 layer, 6 steps: the tests'), gpu
(Llama-style d_model 2048, 8 layers, 16 heads, SwiGLU hidden 5632, 412.1M parameters; batch 8 x
seq 1024 = 8192 tokens a step, 300 steps, lr 3e-4: GEMMs of 8192 tokens and 2048 to 6144
features, sized for FP8 to gain on an H100/H200) and gpu-gpt2 (the earlier gpu preset: GPT
d_model 768, 8 layers, 12 heads, 57.3M parameters, batch 32 x seq 256, 2000 steps, lr 1e-3; at
this size the FP8 casts cost more than the GEMMs save). --arch picks the model: gpt
(examples/gpt.py: pre-LayerNorm, learned positions, GELU MLP, biases) or llama
(examples/llama.py: pre-RMSNorm, rotary positions, SwiGLU MLP, no biases); the default is the
preset's. The text is about 420 KB (train split) and 47 KB (validation split), and every batch
takes windows of seq_len + 1 bytes at random starts, with replacement: the gpu preset goes over
the train split about 6 times and overfits it.

Every run starts from the same seed, sees the same batches in the same order and is evaluated on
the same fixed validation batches. The CPU presets also fix the thread count and cap torch's CPU
kernels at AVX2 (--threads, --cpu-isa), so that the float32 sums split alike on most CPUs: the
baseline's losses are docs/demo.md's to the last digit, the FP8 rows' to the few units of the
last digit that another CPU's kernel choices move (docs/demo.md says how far). The FP8 runs convert the transformer
blocks' nn.Linear layers (qkv, attention projection, MLP up / down, and gate for llama) with
fp8ops.convert_to_fp8; the token / position embeddings and the LM head stay in high precision
(filter_fn), as do LayerNorm / RMSNorm, the rotary embedding, softmax-attention and the loss.
Baseline precision: float32 on CPU; on CUDA every run (the baseline and the non-FP8 ops of the
FP8 runs) runs under bfloat16 autocast.
Optimizer: AdamW, or fp8ops.FP8AdamW with --optimizer fp8adamw (the moments in FP8 with block
scales, --second-moment picks v's format); with --offload, fp8ops.CPUOffloadOptimizer of either:
FP32 masters and the optimizer state on the host, the FP8 layers' weights on the device in FP8
only. The "device state" column counts exactly (fp8ops.memory.device_state_bytes, just before the
last optimizer step) the device bytes of the parameters, gradients, cached FP8 weights, FP8
scaling state and optimizer state; on a CPU-only machine, what a GPU would hold.
Memory: --param-dtype bfloat16 makes the parameters bf16 (with FP8AdamW their updates are
stochastically rounded, and no float32 copy exists); --fp8-activations on (attention) runs the
FP8 runs' steps inside fp8ops.fp8_activations, which saves the norm, GELU/SiLU and SwiGLU inputs
(and attention's q, k, v) for backward in FP8. The "peak mem" column shows what each changes
(bench/bench_memory.py --peak counts it exactly, feature by feature).
Outputs in --out-dir: results.md (the table), loss_curves.png, scaling.png (each FP8 layer's scale
and gradient underflow over the run, from fp8ops.monitor), results.json.

--fsdp: data-parallel training sharded by FSDP2 (torch.distributed.fsdp.fully_shard per transformer
block and at the root; FP8Linear weights all-gathered in FP8 where the recipe allows it), one
process per rank under torchrun (gloo on CPU, NCCL on CUDA, one GPU per process; without torchrun
a single process). Every rank draws the same global batch and trains on its slice of it
(batch_size must divide by the world size), so the run sees the same data as one process; the
train and validation losses are averaged over the ranks. Data-parallel gradients are summed in
another order than one process's, and the FP8 casts of activations and gradients take each rank's
own amax (current scaling) rather than the whole batch's, so the losses agree with the
single-process table to a tolerance, not bit for bit (docs/distributed.md, "Sharded training"). Rank 0
prints the progress and writes results_fsdp.md, results_fsdp.json, loss_curves_fsdp.png and
scaling_fsdp.png (from its own monitor: the scales and underflow of its slice's activations and
gradients; a weight gathered in FP8 is cast shard by shard inside FSDP2's all-gather, which the
monitor does not sample); peak memory and device state are rank 0's (its shards). --fsdp with
--offload is not supported yet. --fp8-reduce-scatter sends every run's gradients (the
baseline's too) through FSDP2's reduce-scatter as FP8 blocks: about half the bytes of bf16
(docs/distributed.md, "Gradients in FP8").

--ddp: data parallel with DistributedDataParallel, one process per rank under torchrun as with
--fsdp (results_ddp.md etc.); --fp8-compress-hook averages every run's gradients in FP8 blocks
(fp8ops.distributed.fp8_compress_hook).

--ep N (with --moe, under torchrun --nproc_per_node=N): each block's experts split over the N
ranks by fp8ops.FP8ExpertParallel, their tokens dispatched in FP8 (examples/expert_parallel.py);
every rank trains on its slice of each batch as under --fsdp, and writes results_epN.md etc.
Recipes: baseline (its experts replicated: FP8ExpertParallel takes FP8 experts), current,
current_stochastic, blockwise.

--moe: the GPT with each block's MLP a mixture of experts (examples/moe.py): a router (an
nn.Linear kept in high precision) sends each token to its top 2 of --experts (default 4) GELU
MLPs of the dense MLP's size, held as 3-D parameters up_proj [E, 4 d_model, d_model] and
down_proj [E, d_model, 4 d_model]. convert_to_fp8 runs the experts as FP8 grouped GEMMs
(fp8ops.grouped_linear, each expert's weight cast once per optimizer step) with the current,
blockwise and delayed recipes (delayed: an amax history per expert); with the others (mxfp8,
current_stochastic) the experts stay in high precision (a warning) and only the dense Linears go
to FP8. The baseline runs the same module's own forward, a loop over the experts. GPT only. With
--fsdp the experts' 3-D parameters are sharded with their block and gathered in FP8 (each rank
casts its shard, as for the dense Linears); with --offload the converted experts' 3-D weights,
as the FP8Linear weights, stay on the device as their FP8 casts only (the baseline's and those of
experts left in high precision stay in their dtype).
--moe only, on the CPU, with torchao 0.18.0 installed: the recipes torchao and torchao_mxfp8
(examples/torchao_moe.py) run the experts' GEMMs (forward, dgrad, wgrad) as torchao's FP8
row-wise grouped recipe (torchao's casts, a float32 grouped GEMM of the dequantized values in
place of torch._scaled_grouped_mm) or its emulated MXFP8 recipe, and keep every other layer in
high precision, as the baseline runs it (no fp8ops layer: --fp8-activations does not apply).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import resource
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8ops  # noqa: E402
from fp8ops.memory import device_state_bytes  # noqa: E402
from data import VOCAB_SIZE, Batches, fixed_batches, load_tokens  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
import scaling_report  # noqa: E402
import expert_parallel  # noqa: E402
import torchao_moe  # noqa: E402  (imports torchao only when its recipes run)

RECIPES = {
    "baseline": lambda: None,
    "delayed": lambda: fp8ops.DelayedScaling(),
    "current": lambda: fp8ops.CurrentScaling(),
    "current_stochastic": lambda: fp8ops.CurrentScaling(grad_rounding="stochastic"),
    "mxfp8": lambda: fp8ops.MXFP8Scaling(),
    "blockwise": lambda: fp8ops.BlockwiseScaling(),
    # not run by default: the outlier-robust amax (99.99th percentile of |x| in each tensor)
    "current_p99.99": lambda: fp8ops.CurrentScaling(amax_percentile=99.99),
    # --moe only: torchao's grouped recipes for the experts, the rest in high precision
    "torchao": lambda: torchao_moe.TorchaoExperts("torchao"),
    "torchao_mxfp8": lambda: torchao_moe.TorchaoExperts("torchao_mxfp8"),
}
OPTIMIZERS = ("adamw", "fp8adamw")
SECOND_MOMENTS = ("sqrt_e4m3", "e5m2", "bf16")
DEFAULT_RECIPES = ["baseline", "delayed", "current", "current_stochastic", "mxfp8", "blockwise"]
# Presets; every field can be overridden by its flag. The CPU presets fix the thread count (but
# for --fsdp) and the instruction set of torch's CPU kernels: a float32 GEMM splits its sums by
# thread and by vector width, and the FP8 casts round what differs into different losses, so
# docs/demo.md's tables hold for this thread count and these kernels.
SIZES = {
    "cpu": dict(device="cpu", steps=200, batch_size=16, seq_len=64, d_model=128, n_layer=2,
                n_head=4, lr=3e-3, eval_every=50, eval_batches=8, threads=2, cpu_isa="avx2",
                arch="gpt"),
    # Llama-style, 412.1M parameters (411.0M of them in the blocks' Linears, which go to FP8):
    # GEMMs of 8192 tokens with K and N of 2048 to 6144, large enough for FP8 to pay for its
    # casts. AdamW's parameters, gradients and state: 16 bytes a parameter, 6.6 GB.
    "gpu": dict(device="cuda", steps=300, batch_size=8, seq_len=1024, d_model=2048, n_layer=8,
                n_head=16, lr=3e-4, eval_every=100, eval_batches=8, arch="llama"),
    # the GPT-2-style preset that --size gpu was until the Llama-style one (docs/demo.md's H200
    # table): at d_model 768 the FP8 casts cost more than the GEMMs save
    "gpu-gpt2": dict(device="cuda", steps=2000, batch_size=32, seq_len=256, d_model=768,
                     n_layer=8, n_head=12, lr=1e-3, eval_every=200, eval_batches=32, arch="gpt"),
    "tiny": dict(device="cpu", steps=6, batch_size=4, seq_len=32, d_model=64, n_layer=1,
                 n_head=2, lr=3e-3, eval_every=3, eval_batches=2, threads=1, cpu_isa="avx2",
                 arch="gpt"),
}
SEQ_LEN_HELP = ("; any length below the train split's 420 KB: every batch takes windows of "
                "seq_len + 1 bytes at random starts, with replacement, so the gpu preset's 300 "
                "steps of 8192 tokens go over the split about 6 times and its model overfits it: "
                "compare the recipes with each other, not with a real corpus's losses")
ARCHS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}
SIZES_HELP = ("preset (default: cpu): cpu = GPT d_model 128, 2 layers, batch 16 x seq 64, float32 "
              "on the CPU; gpu = Llama-style (RMSNorm, rotary, SwiGLU 5632) d_model 2048, 8 "
              "layers, 16 heads, 412.1M parameters, batch 8 x seq 1024 = 8192 tokens a step, "
              "300 steps, for one H100/H200; gpu-gpt2 = the earlier gpu preset: GPT d_model 768, "
              "8 layers, 57.3M parameters, batch 32 x seq 256, 2000 steps; tiny = GPT d_model 64, "
              "1 layer, 6 steps (the tests' size)")


# The switches that cap the instruction set of torch's CPU kernels: ATen's vectorised ops, and
# oneDNN's and MKL's GEMMs. Each library reads its switch at its first call, not at import.
CPU_ISAS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
            "native": {}}


def cap_cpu_kernels(isa: str) -> str:
    """Cap torch's CPU kernels at `isa` (a CPU_ISAS key), before the first torch op runs. An
    AVX-512 GEMM splits a float32 sum otherwise than an AVX2 one, so that the FP8 rows' last
    digits would follow the CPU. A switch already set in the environment wins. Returns the
    instruction set ATen runs."""
    for name, value in CPU_ISAS[isa].items():
        os.environ.setdefault(name, value)
    return torch.backends.cpu.get_cpu_capability()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=SIZES, default="cpu", help=SIZES_HELP)
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="gpt (examples/gpt.py: LayerNorm, learned positions, GELU MLP, biases) or "
                        "llama (examples/llama.py: RMSNorm, rotary positions, SwiGLU MLP of 8/3 "
                        "d_model rounded up to a multiple of 256, no biases); default: the "
                        "preset's (llama for gpu, else gpt)")
    for name in ("steps", "batch_size", "seq_len", "d_model", "n_layer", "n_head", "eval_every",
                 "eval_batches"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help="default: the preset's" + SEQ_LEN_HELP * (name == "seq_len"))
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: the preset's), after a linear warmup and "
                        "down to a tenth of it along a cosine")
    p.add_argument("--device", default=None, help="cpu or cuda (default: from --size)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                   help="comma-separated subset of: " + ", ".join(RECIPES) +
                   " (default: all but current_p99.99, torchao and torchao_mxfp8; the torchao "
                   "ones take --moe)")
    p.add_argument("--fallback", choices=("never", "auto"), default="never",
                   help="FP8 layers' fallback: never (default: every FP8 layer trains in FP8) or "
                        "auto (layers too small to gain from FP8 on this GPU, by its measured "
                        "crossover, run in high precision)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "out"))
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 2 for --size cpu, 1 for tiny, else torch's; "
                        "with --fsdp, --ddp or --ep, torchrun's)")
    p.add_argument("--cpu-isa", choices=CPU_ISAS, default=None,
                   help="the instruction set torch's CPU kernels may use: avx2 (the cpu and tiny "
                        "presets' default: the kernels docs/demo.md's losses were made with) or "
                        "native (the others' default: the fastest this CPU has)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--monitor-every", type=int, default=25,
                   help="sample FP8 scaling statistics every N steps for scaling.png (0: off)")
    p.add_argument("--offload", action="store_true",
                   help="fp8ops.CPUOffloadOptimizer(AdamW): masters and optimizer state on the host")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (torch) or fp8adamw (fp8ops.FP8AdamW: moments in FP8)")
    p.add_argument("--second-moment", choices=SECOND_MOMENTS, default="sqrt_e4m3",
                   help="how fp8adamw stores Adam's second moment (default sqrt_e4m3)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the parameters' dtype (bfloat16 with --optimizer fp8adamw: no float32 "
                        "copy of the weights anywhere)")
    p.add_argument("--fp8-activations", choices=("off", "on", "attention"), default="off",
                   help="FP8 runs: norm, activation and SwiGLU inputs saved for backward in FP8 "
                        "(fp8ops.fp8_activations; 'attention': attention's q, k, v too)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard with FSDP2 over the ranks of torchrun (see the module doc)")
    p.add_argument("--ddp", action="store_true",
                   help="data parallel with DistributedDataParallel over the ranks of torchrun "
                        "(see the module doc)")
    p.add_argument("--fp8-compress-hook", action="store_true",
                   help="with --ddp: every run's gradients averaged in FP8 blocks "
                        "(fp8ops.distributed.fp8_compress_hook)")
    p.add_argument("--fp8-reduce-scatter", action="store_true",
                   help="with --fsdp: FSDP2 reduce-scatters the gradients of every run in FP8 "
                        "blocks (fp8ops.distributed.fp8_reduce_scatter)")
    p.add_argument("--moe", action="store_true",
                   help="each block's MLP a top-2 mixture of --experts GELU experts, run as FP8 "
                        "grouped GEMMs by the current and blockwise recipes (see the module doc)")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (with --moe)")
    p.add_argument("--ep", type=int, default=0, metavar="N",
                   help="with --moe under torchrun --nproc_per_node=N: each block's experts split "
                        "over the N ranks, tokens dispatched in FP8 (see the module doc)")
    args = p.parse_args(argv)
    if args.ddp and (args.fsdp or args.ep or args.offload):
        p.error("--ddp takes none of --fsdp, --ep and --offload")
    if args.fp8_compress_hook and not args.ddp:
        p.error("--fp8-compress-hook is a setting of --ddp's gradient all-reduce")
    if args.fp8_reduce_scatter and not args.fsdp:
        p.error("--fp8-reduce-scatter is a setting of --fsdp's gradient reduce-scatter")
    if args.fsdp and args.offload:
        p.error("--fsdp with --offload is not supported yet (CPUOffloadOptimizer keeps whole "
                "FP32 masters, FSDP2 shards them): use one of them")
    for k, v in SIZES[args.size].items():
        # under --fsdp, --ddp or --ep each rank keeps torchrun's threads (one per process on a shared CPU)
        if getattr(args, k) is None and not (k == "threads" and (args.fsdp or args.ep
                                                                  or args.ddp)):
            setattr(args, k, v)
    if args.moe and args.arch == "llama":
        p.error("--moe takes --arch gpt (examples/moe.py's experts are GELU MLPs)")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in args.recipes if r not in RECIPES]
    if bad:
        p.error(f"unknown recipe(s) {bad}; choose from {list(RECIPES)}")
    torchao = [r for r in args.recipes if r in torchao_moe.RECIPES]
    if torchao and not args.moe:
        p.error(f"recipe(s) {torchao} run torchao's grouped GEMMs for the experts: add --moe")
    if torchao and not args.device.startswith("cpu"):
        p.error(f"recipe(s) {torchao} run on the CPU only (examples/torchao_moe.py stands in "
                "for torchao's GPU kernels)")
    if torchao and torchao_moe.missing():
        p.error(f"recipe(s) {torchao} need torchao: {torchao_moe.missing()}")
    if args.ep:
        if not args.moe or args.fsdp or args.offload:
            p.error("--ep N takes --moe, and neither --fsdp nor --offload")
        if args.experts % args.ep:
            p.error(f"--ep {args.ep}: --experts {args.experts} does not split evenly over the ranks")
        if args.recipes == DEFAULT_RECIPES:
            args.recipes = [r for r in args.recipes if r in expert_parallel.RECIPES]
        other = [r for r in args.recipes if r not in expert_parallel.RECIPES]
        if other:
            p.error(f"--ep: recipe(s) {other} not taken; choose from {list(expert_parallel.RECIPES)}")
    return args


# ---------------------------------------------------------------------------------------------
# memory: CUDA allocator peak on a GPU; on CPU the growth of the process's peak RSS during the run
# ---------------------------------------------------------------------------------------------
def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """On CUDA: torch.cuda.max_memory_allocated. On CPU (Linux): the peak RSS is reset before the
    run (write 5 to /proc/self/clear_refs, after gc and malloc_trim) and the growth of VmHWM over
    the starting VmRSS is reported; where that reset is not possible, the growth of
    resource.getrusage(RUSAGE_SELF).ru_maxrss (a lifetime peak: later runs then under-report)."""

    def __init__(self, device):
        self.device = device
        self.method = "cuda_max_allocated" if device.type == "cuda" else "rss_peak_growth"

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = _rss_kib("VmRSS")
        except OSError:
            self.method = "ru_maxrss_growth"
            self.start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.method == "rss_peak_growth":
            self.peak_mib = (_rss_kib("VmHWM") - self.start) / 1024
        else:
            self.peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.start) / 1024


# ---------------------------------------------------------------------------------------------
# data and expert parallel (--fsdp, --ddp, --ep)
# ---------------------------------------------------------------------------------------------
class Ranks:
    """This process's place in the data-parallel group: one process (rank 0 of 1) without --fsdp,
    --ddp or --ep; with one, the torch.distributed group torchrun set up (gloo on CPU, NCCL on
    CUDA)."""

    def __init__(self, args):
        self.fsdp, self.ddp, self.ep, self.rank, self.world = args.fsdp, args.ddp, args.ep, 0, 1
        self.distributed = bool(args.fsdp or args.ddp or args.ep)
        self.device = torch.device(args.device)
        if not self.distributed:
            return
        import torch.distributed as dist
        self.dist = dist
        if "WORLD_SIZE" not in os.environ:  # not under torchrun: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        kwargs = {}
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", **kwargs)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if args.ep and self.world != args.ep:
            self.close()
            sys.exit(f"--ep {args.ep} runs under torchrun --nproc_per_node={args.ep}, not "
                     f"{self.world} processes")
        if args.batch_size % self.world:
            self.close()
            sys.exit(f"--fsdp / --ddp / --ep: batch_size {args.batch_size} does not divide by "
                     f"the world size {self.world}: every rank takes an equal slice of each batch")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch."""
        n = t.shape[0] // self.world
        return t[self.rank * n:(self.rank + 1) * n]

    def mean(self, value: torch.Tensor) -> float:
        """The mean over the ranks of a scalar (each rank's mean over its equal slice)."""
        if self.world == 1:
            return value.item()
        v = value.detach().float().reshape(1).clone()
        self.dist.all_reduce(v)  # SUM: gloo has no AVG
        return v.item() / self.world

    def shard(self, model):
        """FSDP2: each transformer block, then the root (embeddings, final norm, LM head)."""
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    def replicate(self, model):
        """DDP: the model on every rank, its gradients averaged in buckets."""
        from torch.nn.parallel import DistributedDataParallel
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def close(self, ok=False):
        """Leave the group: after a barrier when every rank finished (ranks other than 0 would
        otherwise tear down their connections while rank 0 still writes its outputs)."""
        if self.distributed and self.dist.is_initialized():
            if ok:
                self.dist.barrier()
            self.dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------
def build_model(args) -> torch.nn.Module:
    """The --arch model of the run's sizes, on the current default device."""
    model_cls, cfg_cls = ARCHS[args.arch]
    moe = dict(n_expert=args.experts) if getattr(args, "moe", False) else {}
    return model_cls(cfg_cls(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, d_model=args.d_model,
                             n_layer=args.n_layer, n_head=args.n_head, **moe))


def count_params(args) -> int:
    """The model's parameter count, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(args).parameters())


def optimizer_name(args) -> str:
    name = "AdamW" if args.optimizer == "adamw" else f"FP8AdamW({args.second_moment})"
    return f"CPUOffloadOptimizer({name})" if args.offload else name


def keep_high_precision(module, fqn):
    """filter_fn for convert_to_fp8: only the transformer blocks' Linears (and, with --moe, their
    experts) go to FP8; a MoE router stays in high precision."""
    return fqn.startswith("blocks.") and not fqn.endswith(".router")


def untimed_steps(steps):
    """The first steps that tokens/s leaves out: one-time costs (CUDA's lazy kernel loading, the
    cuBLAS handle and its heuristics, the allocator's growth) fall there. With every step timed,
    the baseline run first on a fresh H200 measured 0.55x the tokens/s of the same baseline run
    last. 5% of the steps, at least one, and never all of them."""
    return min(steps - 1, max(1, steps // 20))


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, batches, device, autocast, ranks):
    model.eval()
    losses = []
    for x, y in batches:
        with autocast():
            losses.append(ranks.mean(model(ranks.part(x).to(device), ranks.part(y).to(device))))
    model.train()
    return sum(losses) / len(losses)


def run(name, args, train_tokens, val_batches, ranks):
    device = ranks.device
    recipe = RECIPES[name]()
    torchao = isinstance(recipe, torchao_moe.TorchaoExperts)
    torch.manual_seed(args.seed)
    model = build_model(args).to(device, getattr(torch, args.param_dtype))
    if torchao:
        recipe.apply(model)  # the experts only; no fp8ops layer
    elif recipe is not None:
        fp8ops.convert_to_fp8(model, recipe, filter_fn=keep_high_precision,
                              fallback=args.fallback)
        if args.monitor_every:
            fp8ops.monitor(model, every=args.monitor_every)
    if ranks.fsdp:
        ranks.shard(model)
        if args.fp8_reduce_scatter:  # every run's gradients, the baseline's too
            fp8ops.distributed.fp8_reduce_scatter(model)
    if ranks.ddp:
        model = ranks.replicate(model)
        if args.fp8_compress_hook:  # every run's gradients, the baseline's too
            model.register_comm_hook(None, fp8ops.distributed.fp8_compress_hook)
    if ranks.ep and recipe is not None:  # (the baseline's experts stay replicated)
        expert_parallel.parallelize(model, device, ranks.world)
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt_class = torch.optim.AdamW
    if args.optimizer == "fp8adamw":
        opt_class, hyper["second_moment"] = fp8ops.FP8AdamW, args.second_moment
    if args.offload:
        # the non-finite check reuses the norm of the clipping below: free
        opt = fp8ops.CPUOffloadOptimizer(model.parameters(), opt_class, skip_nonfinite=True,
                                         **hyper)
    elif ranks.ep:
        opt = opt_class(expert_parallel.param_groups(model), **hyper)
    else:
        opt = opt_class(model.parameters(), **hyper)
    batches = Batches(train_tokens, args.batch_size, args.seq_len, seed=args.seed + 1)
    if device.type == "cuda":
        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = nullcontext
    saved_in_fp8 = nullcontext
    if recipe is not None and not torchao and args.fp8_activations != "off":
        def saved_in_fp8():
            return fp8ops.fp8_activations(attention=args.fp8_activations == "attention")
    bar = range(args.steps)
    if not args.no_progress and ranks.main:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{name:>18}", leave=True, dynamic_ncols=True)
    train_curve, val_curve, scaling_curve, train_time = [], [], [], 0.0
    untimed = untimed_steps(args.steps)
    with PeakMemory(device) as mem:
        for step in bar:
            x, y = batches.next()  # the global batch; each rank trains on its slice
            x, y = ranks.part(x).to(device), ranks.part(y).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            with autocast(), saved_in_fp8():
                loss = model(x, y)
            loss.backward()
            if args.offload:
                opt.clip_grad_norm_(1.0)  # the gradients are on the host
            elif ranks.ep:
                expert_parallel.reduce_gradients(model, ranks.world)
                expert_parallel.clip_grad_norm_(model, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step == args.steps - 1:  # gradients and optimizer state all there
                state_bytes = device_state_bytes(model, opt)["total"]
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_val = ranks.mean(loss)  # syncs, so the timing is the step's
            if step >= untimed:
                train_time += time.perf_counter() - t0
            train_curve.append(loss_val)
            # untimed: it reads values back (from the model DDP wraps: its monitor)
            scaling_report.sample(model.module if ranks.ddp else model, step + 1, scaling_curve)
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                val_curve.append((step + 1, evaluate(model, val_batches, device, autocast,
                                                     ranks)))
            if not args.no_progress and ranks.main:
                bar.set_postfix(loss=f"{loss_val:.4f}", val=f"{val_curve[-1][1]:.4f}"
                                if val_curve else "-")
    if not args.no_progress and ranks.main:
        bar.close()
    tail = max(1, min(20, args.steps // 10))  # final train loss: mean of the last steps
    return dict(name=name, recipe=repr(recipe) if recipe is not None else "none",
                final_train_loss=sum(train_curve[-tail:]) / tail,
                final_val_loss=val_curve[-1][1], tokens_per_s=(args.steps - untimed)
                * args.batch_size * args.seq_len / train_time, peak_mem_mib=mem.peak_mib, mem_method=mem.method,
                device_state_mib=state_bytes / 2**20, train_curve=train_curve,
                val_curve=val_curve, scaling_curve=scaling_curve)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def table(results, args, device, ranks):
    base = next((r for r in results if r["name"] == "baseline"), None)
    mem_col = "peak mem (MiB, " + results[0]["mem_method"] + ")"
    rows = ["| recipe | final train loss | final val loss | val gap vs baseline | tokens/s | "
            f"{mem_col} | device state (MiB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gap = ("-" if base is None or r is base else
               f"{100 * (r['final_val_loss'] - base['final_val_loss']) / base['final_val_loss']:+.2f}%")
        r["val_gap_pct"] = None if gap == "-" else float(gap.rstrip("%"))
        rows.append(f"| {r['name']} | {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} | "
                    f"{gap} | {r['tokens_per_s']:.0f} | {r['peak_mem_mib']:.1f} | "
                    f"{r['device_state_mib']:.2f} |")
    backend = fp8ops.backend(device)
    ffn = f"ffn_hidden={LlamaConfig(d_model=args.d_model).ffn_hidden} "
    moe = (f"MoE: {args.experts} experts top-2 per block (router in high precision; experts in "
           f"FP8 grouped GEMMs with current / delayed / blockwise, torchao's recipes with "
           f"torchao / torchao_mxfp8, else high precision) "
           if getattr(args, "moe", False) else "")
    fp8_grads = "; gradients reduce-scattered in FP8 blocks" if args.fp8_reduce_scatter else ""
    head = (("GPT" if args.arch == "gpt" else "Llama-style") + f" d_model={args.d_model} "
            f"n_layer={args.n_layer} n_head={args.n_head} " + ffn * (args.arch == "llama") + moe +
            f"params={count_params(args) / 1e6:.1f}M seq_len={args.seq_len} "
            f"batch={args.batch_size} steps={args.steps} lr={args.lr} seed={args.seed} "
            f"threads={torch.get_num_threads()} CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()}; device={device} "
            f"({'bf16 autocast' if device.type == 'cuda' else 'float32'} baseline); optimizer="
            f"{optimizer_name(args)}; parameters {args.param_dtype}; fp8_activations "
            f"{args.fp8_activations}; "
            + (f"FSDP2 over {ranks.world} ranks ({ranks.dist.get_backend()}; memory and device "
               f"state of rank 0{fp8_grads}); " if ranks.fsdp else "")
            + (f"DDP over {ranks.world} ranks ({ranks.dist.get_backend()}"
               f"{'; gradients averaged in FP8 blocks' if args.fp8_compress_hook else ''}); "
               if ranks.ddp else "")
            + (f"experts split over {ranks.world} ranks by FP8ExpertParallel "
               f"({ranks.dist.get_backend()}; tokens dispatched in FP8; the baseline's experts "
               f"replicated; memory and device state of rank 0); " if ranks.ep else "")
            + "fp8ops backend="
            f"{backend} ({backend.reason}); FP8: blocks' Linears only, fallback={args.fallback} "
            f"(embeddings and LM head in high precision); final train loss = mean of the last "
            f"{max(1, min(20, args.steps // 10))} steps; tokens/s over steps "
            f"{untimed_steps(args.steps) + 1}-{args.steps}")
    return head + "\n\n" + "\n".join(rows) + "\n"


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        c = r["train_curve"]
        w = max(1, len(c) // 30)  # running mean for readability
        sm = [sum(c[max(0, i - w + 1):i + 1]) / len(c[max(0, i - w + 1):i + 1]) for i in range(len(c))]
        a1.plot(range(1, len(c) + 1), sm, label=r["name"], lw=1)
        s, v = zip(*r["val_curve"])
        a2.plot(s, v, marker="o", ms=3, label=r["name"], lw=1)
    a1.set(title="train loss (running mean)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    a2.set(title="validation loss", xlabel="step")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    kernels = cap_cpu_kernels(args.cpu_isa or "native")
    if args.cpu_isa == "avx2" and kernels != "AVX2":
        print(f"note: torch's CPU kernels run {kernels}, not AVX2: the FP8 losses' last digits "
              f"may differ from docs/demo.md's", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda asked for, but torch.cuda.is_available() is False")
    ranks = Ranks(args)
    try:
        train_tokens, val_tokens = load_tokens()
        val_batches = fixed_batches(val_tokens, args.eval_batches, args.batch_size,
                                    args.seq_len, seed=args.seed + 12345)
        results = [run(name, args, train_tokens, val_batches, ranks) for name in args.recipes]
        if not ranks.main:
            ranks.close(ok=True)
            return results
        text = table(results, args, ranks.device, ranks)
        print("\n" + text)
        # the single-process table stays
        suffix = ("_fsdp" if args.fsdp else "_ddp" if args.ddp else f"_ep{args.ep}" if args.ep
                  else "")
        names = [f"results{suffix}.md", f"results{suffix}.json", f"loss_curves{suffix}.png",
                 f"scaling{suffix}.png"]
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, names[0]), "w") as f:
            f.write(text)
        with open(os.path.join(args.out_dir, names[1]), "w") as f:
            json.dump(dict(args=vars(args), world=ranks.world, results=results), f, indent=1)
        plot(results, os.path.join(args.out_dir, names[2]))
        drew = scaling_report.plot(results, os.path.join(args.out_dir, names[3]))
        print(f"wrote {args.out_dir}/" + ", ".join(names[:3] + names[3:] * drew))
        ranks.close(ok=True)
        return results
    finally:
        ranks.close()


def exit_now() -> None:
    """End a sharded run once everything is written, without the interpreter's teardown. FSDP2's
    process group outlives destroy_process_group(): DTensor's sharding caches keep its DeviceMesh,
    and with it the gloo/NCCL threads, alive until the interpreter tears the process down
    concurrently with them, in no set order, which now and then aborts the process ("terminate
    called without an active exception") after a successful run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if parse_args(sys.argv[1:]).fsdp:
        exit_now()
