"""Run a worker function on N processes with a torch.distributed process group (gloo on the CPU,
or NCCL on GPU 0) and bring each rank's result back to the pytest process.

    results = spawn(worker, world=2)            # worker(rank, out_dir) -> anything torch.save takes
    results = spawn(worker, world=1, backend="nccl")

The worker must be a module-level function (it is pickled by reference into the spawned
processes; a functools.partial of one works too). Assertions belong in the pytest process, on the
returned results.

Teardown, in this order, on every rank:
  - the rendezvous is a FileStore in the run's temporary directory, not a TCPStore on a port:
    no port is picked, released and bound again (which another process on a shared machine can
    take in between), and no rank hosts the store that the others still use;
  - a barrier once the result is written: no rank tears down while another is still in a
    collective of its own;
  - destroy_process_group(), then os._exit(0). Process groups can outlive
    destroy_process_group(): DTensor's sharding caches keep FSDP2's DeviceMesh, and with it the
    gloo backend (its worker and TCP loop threads) and the store, alive until the interpreter
    tears the process down, concurrently with those threads, in no set order. Leaving with
    os._exit once the result file is closed runs no such teardown.
A worker that raises skips all three: the exception reaches the pytest process and
torch.multiprocessing ends the other ranks (a barrier or destroy_process_group there could hang
on a rank that is gone)."""
from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ranks that issue different collectives fail on this timeout instead of hanging
TIMEOUT = timedelta(seconds=45)


def _entry(rank, world, worker, out_dir, backend):
    torch.set_num_threads(1)
    from fp8ops.nn import fallback
    fallback.MEASURED = {}  # FP8 at every shape, as conftest.py has it in the pytest process
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    store = "file://" + os.path.join(out_dir, "store")
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world,
                            timeout=TIMEOUT, **kwargs)
    result = worker(rank, out_dir)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, world: int = 2, backend: str = "gloo") -> list:
    """[worker(rank, out_dir) for each rank], each run in its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, worker, out_dir, backend), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]
