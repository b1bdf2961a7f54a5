"""Disaggregated placement (runtime.placement=disaggregated): the job's ranks split into
train workers (ranks 0..T-1) and rollout workers (ranks T..T+R-1).

Each side gets its own default process group, so all the code that trains (DDP/FSDP2,
the coordinator's reshards, metrics, checkpoints) or generates runs unchanged among the
ranks of its role, and the two sides never wait on each other's collectives. Two more
groups join them:

  bridge    every rank (world numbering): trajectories, rollout rank -> train rank
  weights   train rank 0 (member 0) and the rollout ranks (1..R): the weight broadcast

Both are gloo groups made directly on a store of their own (not registered with
torch.distributed's default-group machinery), so they can be used from the streaming
threads while the role's main thread runs its own collectives.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from distflow.runtime.process_group import free_port


@dataclass
class Roles:
    role: str  # "train" | "rollout"
    world_rank: int
    train_workers: int
    rollout_workers: int
    bridge: dist.ProcessGroup
    weights: dist.ProcessGroup | None  # None on train ranks other than 0
    store: dist.Store  # kept alive: world rank 0 serves it until the job ends

    @property
    def train_ranks(self) -> range:
        return range(self.train_workers)

    @property
    def rollout_ranks(self) -> range:
        return range(self.train_workers, self.train_workers + self.rollout_workers)

    def close(self) -> None:
        """Meet every rank once more (world rank 0 serves the store), then leave."""
        self.bridge.barrier().wait()


def split_roles(train_workers: int, rollout_workers: int, timeout_s: int, stream_timeout_s: int) -> Roles:
    """Called by every rank of the job's group (train_workers + rollout_workers ranks);
    replaces the default group with the rank's role group (`timeout_s`). The bridge and
    the weights group wait up to `stream_timeout_s`: a receive there is posted for a whole
    step of the other side."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != train_workers + rollout_workers:
        raise ValueError(f"runtime.placement=disaggregated: {world} workers started, but runtime.train_workers="
                         f"{train_workers} + runtime.rollout_workers={rollout_workers} were asked for")
    backend = dist.get_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")  # rank 0's host, as the job's group was made
    port = [free_port(address) if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    store = dist.TCPStore(address, port[0], world, is_master=rank == 0, timeout=timeout)
    dist.barrier()
    dist.destroy_process_group()
    role = "train" if rank < train_workers else "rollout"
    local, size = (rank, train_workers) if role == "train" else (rank - train_workers, rollout_workers)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"role-{role}", store), rank=local,
                            world_size=size, timeout=timeout)
    streams = datetime.timedelta(seconds=stream_timeout_s)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, world, streams)
    weights = None
    if rank == 0 or role == "rollout":
        member = 0 if rank == 0 else rank - train_workers + 1
        weights = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), member, rollout_workers + 1, streams)
    return Roles(role, rank, train_workers, rollout_workers, bridge, weights, store)

