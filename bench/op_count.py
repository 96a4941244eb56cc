"""Operator calls of one FP8Linear training step (forward + backward), per recipe, counted on the
CPU along the Python path a CUDA device takes: the launches a GPU step pays for in host time,
measurable without a GPU. Two kinds of step, on a bf16 layer:

  first       the first micro-batch after an optimizer step (gradients set to None): the weight
              is cast again, and the gradients are written
  accumulate  a later micro-batch: the weight cast is reused, and autograd adds each gradient
              into .grad (those additions are counted apart, as "accumulations": nn.Linear pays
              them too, and a main_grad or the GEMM itself can take them)

    python bench/op_count.py            # the table; tests/test_op_budget.py holds the budget
    python bench/op_count.py --fsdp     # one FSDP2 step (one gloo process): FP8 vs bf16 gather
    python bench/op_count.py --grouped  # FP8GroupedLinear (4 experts) per recipe it takes

Counted with a TorchDispatchMode: each call reaching the dispatcher once (an fp8ops op is one
call, whatever its kernel does inside). "launches" leaves out the calls that only make views or
metadata (no kernel on a GPU); "host syncs" are device-to-host reads (.item(), a tensor used as a
Python bool); "activation copies" are copies or pads of a tensor as large as the input or the
output gradient (for aligned shapes there should be none). "python calls" counts the Python
functions the step enters (sys.setprofile), torch's own included, leaving out the op kernels'
(on a GPU they are C++): the interpreter's share of the host time, which the dispatcher count
does not see."""
from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8ops  # noqa: E402
from fp8ops.ops import emulation  # noqa: E402

_aten = torch.ops.aten
NO_KERNEL = {_aten.view.default, _aten.view.dtype, _aten._unsafe_view.default, _aten.t.default,
             _aten.transpose.int, _aten.alias.default, _aten.slice.Tensor,
             _aten.as_strided.default, _aten.detach.default, _aten.expand.default,
             _aten.unsqueeze.default, _aten.squeeze.dim, _aten.select.int,
             _aten.lift_fresh.default, _aten.permute.default, _aten.reshape.default}
HOST_SYNC = {_aten._local_scalar_dense.default, _aten.is_nonzero.default,
             _aten.equal.default}
COPIES = {_aten.clone.default, _aten.copy_.default, _aten.constant_pad_nd.default,
          _aten._to_copy.default, _aten.contiguous.default}

RECIPES = {
    "delayed": lambda: fp8ops.DelayedScaling(),
    "current": lambda: fp8ops.CurrentScaling(),
    "mxfp8": lambda: fp8ops.MXFP8Scaling(),
    "blockwise": lambda: fp8ops.BlockwiseScaling(),
}


class _Counter(TorchDispatchMode):
    def __init__(self, large: int, grads=()):
        super().__init__()
        self.calls: Counter = Counter()
        self.large = large  # numel from which a copy is an activation copy
        self.activation_copies = 0
        self.grads = {id(g) for g in grads}  # the .grad tensors autograd accumulates into
        self.accumulations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _aten.add_.Tensor and id(args[0]) in self.grads:
            self.accumulations += 1
            return out
        self.calls[func] += 1
        if func in COPIES and isinstance(out, torch.Tensor) and out.numel() >= self.large:
            self.activation_copies += 1
        return out


_OP_KERNELS = os.path.join("fp8ops", "ops", "")


def python_calls(fn) -> int:
    """Python function calls fn makes, not counting those inside fp8ops' op kernels (the
    emulation: C++ on a GPU) or below them."""
    count = skip = 0

    def profile(frame, event, arg):
        nonlocal count, skip
        if event == "call":
            if skip:
                skip += 1
            elif _OP_KERNELS in frame.f_code.co_filename:
                skip = 1
            else:
                count += 1
        elif event == "return" and skip:
            skip -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@contextmanager
def _device_path():
    """The emulation's Python takes the branch a GPU tensor takes (no host fast path)."""
    saved = emulation._on_host
    emulation._on_host = lambda t: False
    try:
        yield
    finally:
        emulation._on_host = saved


def count_step(layer: torch.nn.Module, m: int = 512, warmup: int = 3,
               dtype: torch.dtype = torch.bfloat16, accumulate: bool = False,
               extra_args: tuple = ()) -> dict:
    """The counts of one forward + backward of `layer` (moved to `dtype`, as a bf16 model is
    trained) on an [m, in_features] batch, after `warmup` training steps (an optimizer steps the
    layer, so that its weight cast may be reused between steps). accumulate=False: the first
    micro-batch after an optimizer step and zero_grad (the weight is cast again, the gradients
    written); True: a later micro-batch (the weight's cast is reused, the gradients accumulated
    into). extra_args: the forward's arguments after x (a grouped layer's offsets)."""
    layer = layer.to(dtype)
    k, n = layer.in_features, layer.out_features
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, dtype=dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)  # the weights stay; its steps are seen

    def new_window():
        opt.step()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    with _device_path():
        for _ in range(warmup):
            layer(x, *extra_args).backward(dy)
            new_window()
        if accumulate:
            layer(x, *extra_args).backward(dy)  # the window's first micro-batch casts the weight
        grads = [t.grad for t in (x, *layer.parameters()) if t.grad is not None]
        with _Counter(large=min(m * k, m * n), grads=grads) as counter:
            layer(x, *extra_args).backward(dy)
        if not accumulate:  # the same kind of step again, its Python counted
            new_window()
        py_calls = python_calls(lambda: layer(x, *extra_args).backward(dy))
    calls = counter.calls
    return {
        "calls": sum(calls.values()),
        "launches": sum(c for f, c in calls.items() if f not in NO_KERNEL),
        "host_syncs": sum(c for f, c in calls.items() if f in HOST_SYNC),
        "activation_copies": counter.activation_copies,
        "accumulations": counter.accumulations,
        "python_calls": py_calls,
        "by_op": {str(f): c for f, c in calls.most_common()},
    }


STEPS = ("first", "accumulate")


def table(step: str = "accumulate", k: int = 256, n: int = 384) -> dict:
    """Counts per layer for one kind of step. The weight [n, k] is smaller than the activations
    (m = 512 rows), so that a copy of it is not taken for an activation copy."""
    accumulate = {"first": False, "accumulate": True}[step]
    out = {"nn.Linear": count_step(torch.nn.Linear(k, n), accumulate=accumulate)}
    for name, recipe in RECIPES.items():
        out[name] = count_step(fp8ops.FP8Linear(k, n, recipe=recipe()), accumulate=accumulate)
    return out


GROUPED_RECIPES = ("delayed", "current", "blockwise")  # (grouped_linear takes no MXFP8)


def grouped_table(step: str = "accumulate", experts: int = 4, k: int = 256, n: int = 384,
                  m: int = 2048) -> dict:
    """Counts of FP8GroupedLinear per recipe it takes, for one kind of step: `experts` experts
    of [n, k], m rows split evenly among them (the offsets stay on the device). The experts
    together are smaller than the activations, so that a copy of them is not taken for an
    activation copy."""
    accumulate = {"first": False, "accumulate": True}[step]
    offsets = torch.arange(1, experts + 1, dtype=torch.int32) * (m // experts)
    return {name: count_step(fp8ops.nn.FP8GroupedLinear(experts, k, n, recipe=RECIPES[name]()),
                             m=m, accumulate=accumulate, extra_args=(offsets,))
            for name in GROUPED_RECIPES}


FSDP_SETUPS = ("bf16", "current:bf16", "current:fp8", "delayed:bf16", "delayed:fp8",
               "blockwise:bf16", "blockwise:fp8")


def fsdp_table(model_name: str = "tiny", warmup: int = 2) -> dict:
    """Kernel-launching calls of one FSDP2 training step (forward, backward, AdamW step) of
    bench/bench_comm.py's model and sharding, per setup ("<recipe>:fp8": FP8 weight all-gather,
    ":bf16" the high-precision one), in this process's process group, with the number of FP8
    layers. What the FP8 gather adds per layer is the difference of the two."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_comm
    import torch.distributed as dist
    out = {}
    for setup in FSDP_SETUPS:
        model, loss_fn, converted = bench_comm.build(model_name, setup, torch.device("cpu"),
                                                     dist.get_world_size(), 16,
                                                     fresh_batches=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with _device_path():
            for _ in range(warmup):
                step()
            with _Counter(large=1 << 62) as counter:
                step()
        calls = counter.calls
        out[setup] = {"launches": sum(c for f, c in calls.items() if f not in NO_KERNEL),
                      "layers": len(converted), "by_op": {str(f): c for f, c in calls.items()}}
    return out


def _fsdp_main() -> None:
    import tempfile
    import bench_comm
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        bench_comm.init_rank(0, 1, "gloo", tmp, threads=torch.get_num_threads())
        rows = fsdp_table()
        dist.destroy_process_group()
    print("| setup | launches | FP8 gather's extra launches per FP8Linear |\n|---|---|---|")
    for setup, r in rows.items():
        recipe, _, gather = setup.partition(":")
        extra = ("-" if gather != "fp8" else
                 f"{(r['launches'] - rows[recipe + ':bf16']['launches']) / r['layers']:.2f}")
        print(f"| {setup} | {r['launches']} | {extra} |")
    sys.stdout.flush()
    os._exit(0)  # FSDP2's process group outlives destroy_process_group (bench_comm.leave_rank)


def main() -> None:
    if "--fsdp" in sys.argv[1:]:
        _fsdp_main()
    grouped = "--grouped" in sys.argv[1:]
    for step in STEPS:
        rows = grouped_table(step) if grouped else table(step)
        print(f"\n## {'FP8GroupedLinear, ' if grouped else ''}{step} micro-batch\n")
        print("| layer | calls | launches | accumulations | host syncs | activation copies | "
              "python calls |")
        print("|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['calls']} | {r['launches']} | {r['accumulations']} | "
                  f"{r['host_syncs']} | {r['activation_copies']} | {r['python_calls']} |")
        for name, r in rows.items():
            print(f"\n{name}: " + ", ".join(f"{op} x{c}" for op, c in r["by_op"].items()))


if __name__ == "__main__":
    main()
