"""Process-group setup shared by every launcher: the worker side of the runtime."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import importlib
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def headline(error: BaseException) -> str:
    """An error as a one-line report gives it: its type and its message's first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_entry(entry: str) -> Callable[..., Any]:
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def group_backend(use_cuda: bool) -> str:
    """On GPU one group with two backends: CUDA tensors (FSDP/DDP, GPU payloads) over NCCL,
    CPU tensors (the coordinator's metadata and shared-memory handshakes, metrics,
    object collectives) over gloo; subgroups inherit both. NCCL alone refuses CPU tensors."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest M_MMAP_THRESHOLD on 64-bit


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks of up to 32 MiB in the heap for the next allocation,
    instead of returning them to the kernel, whose fresh pages every new tensor would
    then fault in again (by default a freed block over the adaptive threshold, and the
    heap's free top past twice it, go back). A worker allocates tensors of the same
    sizes every step: the coordinator's new batches, micro-batches, activations. The
    price is that the worker's RSS stays near its peak, as PyTorch's CUDA caching
    allocator keeps GPU memory. Returns False where libc has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1


# how long the workers wait for each other to form the group at the start: a worker that cannot
# reach rank 0 (the wrong network interface) fails after this, not after runtime.collective_timeout_s
RENDEZVOUS_TIMEOUT_S = 300
DEVICE_ENV = "DISTFLOW_WORKER_DEVICE"  # the device init_process_group chose for this worker: cuda or cpu


def uses_cuda(device: str) -> bool:
    """Whether this worker runs on a GPU (runtime.device): with `auto`, where there is one
    for every worker on this host (LOCAL_WORLD_SIZE; a Ray worker is given its own or told
    `cpu`): two workers on one GPU fail in NCCL ("Duplicate GPU detected")."""
    if device == "cpu" or not torch.cuda.is_available():
        return False
    workers, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
    if workers <= gpus:
        return True
    if device == "cuda":
        raise RuntimeError(f"runtime.device=cuda: {workers} workers on this host and {gpus} GPUs; each worker "
                           f"needs its own (runtime.num_workers={gpus} per host, or runtime.device=auto: CPU)")
    return False


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int,
                       device: str, timeout_s: int, threads: int) -> torch.device:
    """Join the job's process group (gloo on CPU; gloo and NCCL on GPU, see group_backend);
    returns this rank's device. Freed host memory is kept for reuse (keep_freed_memory).
    A worker killed by a fatal signal (an abort in a C++ library, a segfault) prints every
    thread's Python stack to stderr first (faulthandler)."""
    os.environ.update(WORKER_ENV)
    faulthandler.enable()
    keep_freed_memory()
    os.environ["MASTER_ADDR"] = master_addr  # rank 0's host: later groups (runtime/roles.py) meet there too
    use_cuda = uses_cuda(device)
    os.environ[DEVICE_ENV] = "cuda" if use_cuda else "cpu"
    if not use_cuda:
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    forming = min(timeout_s, RENDEZVOUS_TIMEOUT_S)
    try:
        dist.init_process_group(
            backend=group_backend(use_cuda),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=forming),
        )
    except (dist.DistStoreError, dist.DistNetworkError) as e:  # not every worker joined; rank 0 not reachable
        raise RuntimeError(f"worker {rank}: the process group of {world_size} did not form within {forming} s at "
                           f"rank 0's {master_addr}:{master_port} (a worker that cannot reach that address: set "
                           f"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on the nodes); "
                           f"{headline(e)}") from None
    # from now on a collective waits for its slowest worker as long as runtime.collective_timeout_s says
    full = datetime.timedelta(seconds=timeout_s)
    dist.distributed_c10d._set_pg_timeout(full)
    dist.distributed_c10d._get_default_store().set_timeout(full)
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def run_in_group(entry: str, args: tuple, rank: int, world_size: int, master_addr: str,
                 master_port: int, device: str, timeout_s: int, threads: int) -> Any:
    """Initialise the group, run `entry(*args)`, always tear the group down."""
    init_process_group(rank, world_size, master_addr, master_port, device, timeout_s, threads)
    with process_group_closed_on_exit():
        return resolve_entry(entry)(*args)


@contextlib.contextmanager
def process_group_closed_on_exit():
    """Tear the group down when the block ends. After a clean run the ranks first meet at
    a barrier, so that no rank (rank 0 hosts the rendezvous store) leaves while another
    is still inside the group; after a failure each rank leaves at once (waiting for a
    peer that died would hang until the collective timeout)."""
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    dist.destroy_process_group()
