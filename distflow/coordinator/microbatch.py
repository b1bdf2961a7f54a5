"""Micro-batches that keep ranks in lockstep and balanced.

FSDP runs collectives inside every forward and backward, so every rank must run the
same number of micro-batches. The count is agreed with one all-reduce (MAX); a rank
with fewer samples runs empty micro-batches, which the engine turns into a zero-loss
forward on a masked row. Two policies:

* fixed size (`micro_batch_size`): consecutive chunks, order kept;
* token budget (`max_tokens`, verl's `use_dynamic_bsz`): the fewest micro-batches whose
  Karmarkar-Karp partition fits the budget, so a micro-batch of short sequences holds
  more of them and no micro-batch is a straggler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distflow.collectives import all_reduce_max
from distflow.coordinator.partition import karmarkar_karp


def _count_for_budget(lengths: Sequence[int], max_tokens: int) -> int:
    if max(lengths, default=0) > max_tokens:
        raise ValueError(f"actor.max_tokens_per_micro_batch={max_tokens} is smaller than a "
                         f"{max(lengths)}-token sequence; raise it to at least that")
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while k < len(lengths) and max(sum(lengths[i] for i in p) for p in karmarkar_karp(lengths, k)) > max_tokens:
        k += 1
    return k


def local_micro_batches(lengths: Sequence[int], *, micro_batch_size: int | None = None,
                        max_tokens: int | None = None) -> list[list[int]]:
    """This rank's micro-batches before the count is agreed (no collective)."""
    assert (micro_batch_size is None) != (max_tokens is None), "give exactly one policy"
    n = len(lengths)
    if micro_batch_size is not None:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    if not n:
        return []
    return [sorted(p) for p in karmarkar_karp(list(lengths), _count_for_budget(list(lengths), max_tokens))]


def plan_micro_batches(lengths: Sequence[int], *, micro_batch_size: int | None = None,
                       max_tokens: int | None = None, group=None) -> list[list[int]]:
    """Row indices of each micro-batch; the same number of micro-batches on every rank."""
    parts = local_micro_batches(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    k = all_reduce_max(max(len(parts), 1), group)
    if max_tokens is not None and parts and len(parts) < k:  # more, smaller parts balance better
        parts = [sorted(p) for p in karmarkar_karp(list(lengths), k)]
    return parts + [[] for _ in range(k - len(parts))]
