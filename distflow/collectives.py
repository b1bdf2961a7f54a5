"""The small collectives every layer shares: sums, integer sums, maxima and object
gathers over the default process group. Each is the identity without a process group,
so the same code runs in one process (tests, a single worker).

A leaf module (torch only): the coordinator, the scheduler, the node library and the
checkpoint code all reduce through these, never through a copy of their own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_first_rank() -> bool:
    """Rank 0, or the only process: where a value every rank holds alike is counted once."""
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce_sum(*values: float) -> list[float]:
    """Every rank's `values` summed element-wise, in float64."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_int(value: int) -> int:
    """Every rank's `value` summed, exactly (int64)."""
    t = torch.tensor([value], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return int(t)


def all_reduce_max(value: int, group=None) -> int:
    """The largest of every rank's `value`."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (small metadata only), in rank order; [obj] without a process group."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
