"""Run a worker function on N processes with a torch.distributed process group (gloo on the CPU,
or NCCL on GPU 0) and bring each rank's result back to the pytest process.

    results = spawn(worker, world=2)            # worker(rank, out_dir) -> anything torch.save takes
    results = spawn(worker, world=1, backend="nccl")

The worker must be a module-level function (it is pickled by reference into the spawned
processes). Assertions belong in the pytest process, on the returned results."""
from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ranks that issue different collectives fail on this timeout instead of hanging
TIMEOUT = timedelta(seconds=45)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, worker, port, out_dir, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT, **kwargs)
    try:
        result = worker(rank, out_dir)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(worker, world: int = 2, backend: str = "gloo") -> list:
    """[worker(rank, out_dir) for each rank], each run in its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, worker, free_port(), out_dir, backend), nprocs=world,
                 join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]
