"""A reshard delivered in micro-batch chunks, double-buffered.

The plan is made once, for the whole batch. Every rank then cuts every rank's
destination samples into the consumer's micro-batches (all lengths are known after the
metadata all-gather, so this needs no further talk and every rank agrees). Chunk i is
the sub-plan of the moves that land in some rank's micro-batch i; it is exchanged on the
background group while the consumer computes on chunk i-1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from distflow.coordinator.double_buffer import DoubleBuffer, EventLog, background_group
from distflow.coordinator.executor import TransferStats, execute, plan_collectively
from distflow.coordinator.layout import Layout
from distflow.coordinator.planner import ReshardPlan
from distflow.data.batch import Batch

Chunker = Callable[[list[int]], list[list[int]]]  # lengths -> row indices of each micro-batch


def chunk_plans(plan: ReshardPlan, lengths: dict[int, int], ranks: Sequence[int],
                chunker: Chunker) -> list[ReshardPlan]:
    """Split `plan` into sub-plans, chunk i holding every rank's micro-batch i."""
    chunk_of: dict[tuple[int, int], int] = {}
    count = 0
    for rank in ranks:
        mine = plan.samples_for(rank)
        parts = chunker([lengths[s] for s in mine])
        count = max(count, len(parts))
        for i, rows in enumerate(parts):
            chunk_of.update({(mine[j], rank): i for j in rows})
    subs = []
    for i in range(count):
        moves = [m for m in plan.moves if chunk_of[(m.sample, m.dst)] == i]
        keep = {r: [s for s in kept if chunk_of[(s, r)] == i] for r, kept in plan.keep.items()}
        subs.append(ReshardPlan(plan.assignment, moves, keep))
    return subs


def stream_reshard(batch: Batch, sample_ids: Sequence[int], lengths: Sequence[int], src: Layout,
                   dst: Layout, chunker: Chunker, *, balance: str = "kk", tolerance: float = 0.0,
                   stats: TransferStats | None = None,
                   log: EventLog | None = None) -> Iterator[tuple[int, tuple[Batch, list[int]]]]:
    """Plan on the default group; yield (i, (chunk batch, chunk sample ids)) with chunk
    i+1 already in flight on the background group."""
    plan, all_lengths = plan_collectively(sample_ids, lengths, src, dst, balance=balance,
                                          tolerance=tolerance, stats=stats)
    subs = chunk_plans(plan, all_lengths, range(dst.world_size), chunker)
    group = background_group()
    return iter(DoubleBuffer(lambda i: execute(subs[i], batch, sample_ids, group, stats), len(subs), log))
